"""A prefill and a decode engine joined by a real KV transfer over the bulk TCP path (DisaggPair), in a fresh
process, so the sender's reused-thread pools hold no idle thread yet and its first push must start one.
``python thread_refusal_process.py PREFIX``: starting a thread named PREFIX... is refused during the first
push (as a pids limit would), then allowed for a second. Prints one JSON line: the first push's error and
status code, whether every block came back on both engines after it, and the second push's tokens beside the
reference's."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the tests' helpers

from kvtransfer.errors import TransferFailed  # noqa: E402
from tests.integration.kv_helpers import tiny_model  # noqa: E402
from workers.disagg_pair import DisaggPair  # noqa: E402
from workers.runtime.engine import EngineConfig  # noqa: E402
from workers.runtime.generate import GenerateRequest, generate  # noqa: E402
from workers.runtime.loader import LoadedModel  # noqa: E402
from workers.runtime.sampler import SamplingParams  # noqa: E402

PROMPT = [(5 * i) % 120 + 1 for i in range(40)]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(dtype="float32", block_size=4, kv_cache_bytes=8 << 20)


def sockets() -> int:
    """Sockets this process holds open (both engines' ends of any connection between them included)."""
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def main(prefix: str) -> dict:
    model = tiny_model()
    bundle = LoadedModel(Path("."), model.cfg, model, None, (0,))
    expected = generate(bundle, [GenerateRequest(prompt_ids=PROMPT, params=PARAMS)], CONFIG)[0].token_ids
    start = threading.Thread.start

    def refused_start(thread: threading.Thread) -> None:
        if thread.name.startswith(prefix):
            raise RuntimeError("can't start new thread")
        start(thread)
    out: dict = {"expected": expected}
    with DisaggPair(bundle, ("fp32", "fp32"), prefill=CONFIG, decode=CONFIG, transport="tcp") as pair:
        held = sockets()
        threading.Thread.start = refused_start  # type: ignore[method-assign, assignment]
        began = time.monotonic()
        try:
            pair.run([PROMPT], PARAMS)
            out["error"] = None
        except TransferFailed as exc:
            out.update(error=exc.message, code=exc.code.name)
        finally:
            threading.Thread.start = start  # type: ignore[method-assign]
            out["failed_after_s"] = round(time.monotonic() - began, 2)
        time.sleep(0.5)  # for the receiver to see a closed connection's end
        out["sockets_left"] = sockets() - held
        stats, prefill = pair.decode.stats(), pair.prefill.stats()
        out["blocks_back"] = stats.blocks_free == stats.blocks_total and prefill.blocks_free == prefill.blocks_total
        began = time.monotonic()
        out["tokens_after"] = pair.run([PROMPT], PARAMS)[0].token_ids
        out["next_after_s"] = round(time.monotonic() - began, 2)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
