"""Run, through Triton's interpreter on CPU, one layer of the 1b preset's shape (hidden 2048, 32 heads, 4 KV
heads, head dim 64, intermediate 5632, block size 16) and one of the CUDA tests' tiny shape (head dim 16, 2 KV
heads, blocks of 4 and 16) the way ``make gpu-check`` drives the engine, and the fused codecs on their blocks;
print every launch's specialisation (``triton_launches.record``) as JSON on the last line (``python
triton_launch_probe.py [all|preset|rest]``: the two halves can run side by side). Run by
test_triton_compile.py in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton is imported), which
then compiles each specialisation for sm_90.

What is driven: for float32 and bfloat16 models with a cache of the model's dtype, int8 and fp8, a chunked
prefill (a chunk over cached context goes through the paged prefill kernel), eager decode steps, and the
decode graphs' variants (``cuda_graphs.graph_variants``: padded buckets at the short and the long context
bound, the latter through the split kernels); the warm-up's profile step is a fresh prompt of the same
kernels. Then each fused codec encodes a float32 and a bfloat16 cache and an int8 and an fp8 quantised one,
as keys and as values, and decodes into both float dtypes, and the device checksum reads each payload.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Literal

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from triton_launches import record  # noqa: E402  # after the interpreter is switched on

from workers.runtime.config import ModelConfig  # noqa: E402
from workers.runtime.cuda_graphs import DecodeBuffers, bucket_ladder, graph_variants  # noqa: E402
from workers.runtime.engine import Engine, EngineConfig  # noqa: E402
from workers.runtime.model import DecoderModel  # noqa: E402
from workers.runtime.presets import PRESETS  # noqa: E402
from workers.runtime.sampler import SamplingParams  # noqa: E402

MAX_MODEL_LEN = 4096  # the preset's max_position_embeddings: what the graphs' long bound is on the GPU
BUCKETS = (1, 8)  # the specialisations do not depend on the bucket; two of them, one padded
CacheChoice = Literal["auto", "int8", "fp8"]
Runs = tuple[tuple[torch.dtype, tuple[CacheChoice, ...]], ...]  # (model dtype, cache dtypes)
# as gpu-check runs them: the preset in float32 (parity) and in bfloat16 with every cache kind; the tiny
# models with every cache kind in both
PRESET_RUNS: Runs = ((torch.float32, ("auto",)), (torch.bfloat16, ("auto", "int8", "fp8")))
TINY_RUNS: Runs = ((torch.float32, ("auto", "int8", "fp8")), (torch.bfloat16, ("auto", "int8", "fp8")))
TINY_16_RUNS: Runs = ((torch.float32, ("auto", "int8")),)  # blocks of 16: the CUDA graph and parity tests


def preset_config() -> ModelConfig:
    return dataclasses.replace(PRESETS["1b"], num_layers=1, vocab_size=512).config(1, (2,))


def tiny_config() -> ModelConfig:
    """The shape of the CUDA tests' tiny models (tests/integration/kv_helpers.tiny_model, tiny_hf): head dim 16."""
    return ModelConfig("LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, eos_token_ids=(0,))


def engine_launches(cfg: ModelConfig, runs: Runs, block_size: int, max_model_len: int) -> None:
    for dtype, caches in runs:
        torch.manual_seed(0)
        model = DecoderModel(cfg, dtype, "cpu")
        for cache_dtype in caches:
            engine = Engine(model, None, EngineConfig(
                device="cpu", dtype="float32" if dtype == torch.float32 else "bfloat16", kernels="triton",
                kv_cache_dtype=cache_dtype, kv_cache_bytes=1 << 24, max_num_seqs=8, prefill_chunk_size=16,
                block_size=block_size))
            for i, n in enumerate((20, 3)):
                engine.add_request(str(i), list(range(3, 3 + n)), SamplingParams(max_tokens=2, temperature=0.0,
                                                                               ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            cache = engine.cache
            buffers = DecodeBuffers(max(BUCKETS), cache.blocks_for(max_model_len), cache.block_size, cache.device)
            assert engine._ops is not None
            for b, bound in graph_variants(bucket_ladder(max(BUCKETS)), cfg.num_kv_heads, max_model_len,
                                           cache.block_size):
                if b in BUCKETS:
                    buffers.stage([], b)
                    model(buffers.batch(b, bound), cache, None, engine._ops)


def codec_launches(bs: int, heads: int, dim: int) -> None:
    from kvtransfer.codecs.encoded import Kind
    from kvtransfer.codecs.fused import FUSED_CODECS, decode_blocks, encode_blocks
    from kvtransfer.codecs.paged import QuantizedBlocks
    from kvtransfer.codecs.registry import get_codec
    from kvtransfer.device_checksum import kernel_checksum

    blocks = 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((blocks, bs, heads, dim), generator=gen)
    scales = x.abs().amax(-1).clamp_min(1e-12)
    sources: list[Any] = [x, x.to(torch.bfloat16),
                          QuantizedBlocks((x / scales[..., None] * 127).round().to(torch.int8), scales / 127,
                                          torch.bfloat16),
                          QuantizedBlocks((x / scales[..., None] * 448).to(torch.float8_e4m3fn), scales / 448,
                                          torch.bfloat16)]
    ids = torch.tensor([2, 0], dtype=torch.long)
    for name in FUSED_CODECS:
        codec = get_codec(name)
        for kind in (Kind.KEY, Kind.VALUE):
            for src in sources:
                payload = torch.empty(codec.payload_nbytes((2, bs, heads, dim), kind), dtype=torch.uint8)
                enc = encode_blocks(codec, src, ids, kind, payload)
                for dtype in (torch.float32, torch.bfloat16):
                    decode_blocks(codec, enc, torch.zeros((blocks, bs, heads, dim), dtype=dtype), ids)
            kernel_checksum(payload)  # as a CUDA IPC chunk's bytes are checked (its size is the kind's, any source)


def main(part: str = "all") -> list[dict[str, Any]]:
    """``part``: "preset" (the preset's engine runs, about half the time), "rest" (everything else) or "all"."""
    if part not in ("all", "preset", "rest"):
        raise SystemExit(f"part must be all, preset or rest, not {part!r}")
    with record() as specs:
        if part != "rest":
            engine_launches(preset_config(), PRESET_RUNS, 16, MAX_MODEL_LEN)
        if part != "preset":
            codec_launches(16, 4, 64)
            engine_launches(tiny_config(), TINY_RUNS, 4, 1024)  # the KV tests' engines use blocks of 4
            codec_launches(4, 2, 16)
            engine_launches(tiny_config(), TINY_16_RUNS, 16, 1024)
    for spec in specs:  # the codecs' launcher turns fp-fusion off on a GPU only (fused._launch)
        if spec["module"].startswith("kvtransfer.codecs."):
            spec["options"].setdefault("enable_fp_fusion", False)
    return specs


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:2])))
