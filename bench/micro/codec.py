"""``codec``: encode and decode of one KV tensor per codec, against memcpy of the same bytes.

Input: one layer's keys, [blocks, 16, 8, 128] (16 MiB of bf16; 4 MiB with --quick), seeded random
normal values, bf16 for the quantising codecs and bf16, float32 for the fp32 codec (its use: a float32
cache). Figures are input bytes per second (GB/s, decimal), encode into a new ``EncodedTensor`` and
``decode_into`` a preallocated tensor of the input's dtype, the receiver's path. The reference copies
the same input bytes into a preallocated tensor (``dst.copy_(src)``), in the same repeat, with the same
torch thread count, on the --clock (CPU time by default). int4 compresses keys per channel and values
per token, so it is measured for both.
"""

from __future__ import annotations

import torch

from bench.micro.results import Result
from bench.micro.timing import Plan, paired, seconds_of
from kvtransfer.codecs import Kind, available_codecs, get_codec

MiB = 2**20
BLOCK, HEADS, DIM = 16, 8, 128


def _input(dtype: torch.dtype, mib: int) -> torch.Tensor:
    blocks = max(1, mib * MiB // (BLOCK * HEADS * DIM * 2))
    g = torch.Generator().manual_seed(0)
    return torch.randn(blocks, BLOCK, HEADS, DIM, generator=g).to(dtype)


def run(plan: Plan) -> list[Result]:
    mib = 4 if plan.quick else 16
    threads = torch.get_num_threads()
    out: list[Result] = []
    for name in available_codecs():
        codec = get_codec(name)
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        x = _input(dtype, mib)
        dst = torch.empty_like(x)
        nbytes = x.nbytes
        copy = seconds_of(lambda: dst.copy_(x), plan.timer)
        kinds = (Kind.KEY, Kind.VALUE) if name == "int4" else (Kind.KEY,)
        for kind in kinds:
            enc = codec.encode(x, kind)  # warm-up, and the tensor decode reads
            codec.decode_into(enc, dst)
            copy()
            tag = f"codec.{name}" + (f".{kind.value}" if len(kinds) > 1 else "")
            wire = enc.nbytes / nbytes
            ref = f"memcpy of the same {nbytes / MiB:.0f} MiB ({x.dtype}, {threads} thread(s))"
            for op, fn in (("encode", lambda: codec.encode(x, kind)), ("decode", lambda: codec.decode_into(enc, dst))):
                figs, refs = paired(seconds_of(fn, plan.timer), copy, plan)
                out.append(Result(f"{tag}.{op}", "codec", "GB/s", "higher", ref,
                                  tuple(nbytes / s / 1e9 for s in figs), tuple(nbytes / s / 1e9 for s in refs),
                                  note=f"wire bytes {wire:.3f}x the input; {plan.clock} clock"))
    return out
