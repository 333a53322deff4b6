"""A prefill and a decode engine joined by a real KV transfer (DisaggPair), run where /dev/shm is too small
for one shared-memory segment: the shm-full test runs it in a private mount namespace over a tiny tmpfs.
``python shm_full_process.py TRANSPORT [--fill]``; prints one JSON line: the tokens and the transport the push took,
or the error it failed with, and whether the decode engine got every block back."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the tests' helpers

from kvtransfer.errors import TransferFailed  # noqa: E402
from tests.integration.kv_helpers import tiny_model  # noqa: E402
from workers.disagg_pair import DisaggPair  # noqa: E402
from workers.runtime.engine import EngineConfig  # noqa: E402
from workers.runtime.generate import GenerateRequest, generate  # noqa: E402
from workers.runtime.loader import LoadedModel  # noqa: E402
from workers.runtime.sampler import SamplingParams  # noqa: E402

PROMPT = [(7 * i) % 120 + 1 for i in range(200)]  # 100 KiB of fp32 KV: more than the tmpfs holds
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(dtype="float32", block_size=4, kv_cache_bytes=16 << 20)


def main(transport: str, fill: bool) -> dict:
    """``fill``: /dev/shm (room for a segment) is first filled by another file, which goes after one push;
    the push after that one runs too."""
    model = tiny_model()
    bundle = LoadedModel(Path("."), model.cfg, model, None, (0,))
    expected = generate(bundle, [GenerateRequest(prompt_ids=PROMPT, params=PARAMS)], CONFIG)[0].token_ids
    filler = Path("/dev/shm/not-epd-filler")
    if fill:
        with filler.open("wb") as f:
            os.posix_fallocate(f.fileno(), 0, os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize)
    with DisaggPair(bundle, ("fp32", "fp32"), prefill=CONFIG, decode=CONFIG, transport=transport) as pair:  # type: ignore[arg-type]
        out: dict = {"expected": expected}
        try:
            result = pair.run([PROMPT], PARAMS)[0]
            out.update(tokens=result.token_ids, transport=result.push.transport)
            if fill:
                filler.unlink()
                again = pair.run([PROMPT], PARAMS)[0]
                out.update(tokens_after=again.token_ids, transport_after=again.push.transport)
        except TransferFailed as exc:
            out.update(error=exc.message)
        stats, prefill = pair.decode.stats(), pair.prefill.stats()
        out["blocks_back"] = stats.blocks_free == stats.blocks_total and prefill.blocks_free == prefill.blocks_total
        return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], "--fill" in sys.argv)), flush=True)
