"""Codec throughput against memcpy, measured in the same run.

    python -m bench.codec_bench [--mib 64] [--threads 1] [--reps 5]

GB/s counts the tensor's logical bf16 bytes (numel * 2) for encode and decode alike. Decode
writes into a preallocated bf16 tensor (the receiver's path). memcpy is `dst.copy_(src)` into a
preallocated tensor of the same size. Best of `reps`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvtransfer.codecs import Kind, available_codecs, get_codec

# A typical KV layout: 16-token blocks, 8 kv heads, head_dim 128.
BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 8, 128


def best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="size of the bf16 input tensor (MiB)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    per_block = BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2
    n_blocks = max(1, args.mib * 2**20 // per_block)
    shape = (n_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logical = x.numel() * 2
    dst = torch.empty_like(x)

    memcpy = logical / best_seconds(lambda: dst.copy_(x), args.reps) / 1e9
    print(f"shape {list(shape)} bf16, {logical / 2**20:.0f} MiB, {args.threads} thread(s), best of {args.reps}")
    print(f"memcpy reference: {memcpy:.2f} GB/s")
    print(f"{'codec':<6} {'kind':<6} {'wire':>6} {'enc GB/s':>9} {'x memcpy':>9} {'dec GB/s':>9} {'x memcpy':>9}")
    for name in available_codecs():
        codec = get_codec(name)
        for kind in (Kind.KEY, Kind.VALUE) if name == "int4" else (Kind.KEY,):
            enc = codec.encode(x, kind)
            enc_gbs = logical / best_seconds(lambda: codec.encode(x, kind), args.reps) / 1e9
            dec_gbs = logical / best_seconds(lambda: codec.decode_into(enc, dst), args.reps) / 1e9
            print(
                f"{name:<6} {kind.value:<6} {enc.nbytes / logical:>6.3f} {enc_gbs:>9.2f} {enc_gbs / memcpy:>9.3f}"
                f" {dec_gbs:>9.2f} {dec_gbs / memcpy:>9.3f}"
            )


if __name__ == "__main__":
    main()
