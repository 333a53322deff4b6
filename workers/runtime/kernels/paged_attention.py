"""Paged attention in Triton: queries attend to the KV cache through block tables on the device.

Contracts shared by both kernels:
  * the cache is one layer's ``CacheTensors`` (dense float, or int8/fp8 with a float32 scale per
    (slot, kv head)); a value read from it is dequantised and rounded to the query dtype, as the
    torch path's ``storage.gather(slots, q.dtype)`` does;
  * ``block_tables`` is [rows, max_blocks] int32 and is read only up to each row's length;
  * GQA: query head ``h`` reads kv head ``h // (H // Hkv)``;
  * nothing is gathered into a dense copy and nothing is read back to the host, so a decode step
    can be captured in a CUDA graph;
  * a row of length 0 (a padded slot) reads nothing and outputs zeros, never NaN.
The cache block size must be a power of two; a loop iteration reads ``KEYS_PER_TILE`` keys (or one
block, when blocks are larger), looking each key's block up in the table.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from workers.runtime.attention import PREFILL_BLOCK_M, PrefillTiles
from workers.runtime.kernels.cache_views import CacheTensors, scale_args
from workers.runtime.kernels.fp8 import e4m3_to_f32

# Launch options: fused multiply-adds are fine in attention (stated, since Triton warns when it is not).
FUSED = {"enable_fp_fusion": True}
KEYS_PER_TILE = 64  # keys per loop iteration of both kernels (a multiple of the block size)
# Read when triton.jit is: the interpreter computes a bf16/fp16 tl.dot wrongly, so it dots in float32.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _load_kv(ptr, s_ptr, slots, kh, d, valid, dmask, stride_s, stride_h, sstride_s,
             KIND: tl.constexpr, OUT: tl.constexpr):
    """[len(slots), BLOCK_D] of kv head ``kh``, dequantised, rounded to OUT, returned in OUT."""
    x = tl.load(ptr + slots[:, None] * stride_s + kh * stride_h + d[None, :],
                mask=valid[:, None] & dmask[None, :], other=0)
    if KIND == 2:
        x = e4m3_to_f32(x)
    x = x.to(tl.float32)
    if KIND != 0:
        sc = tl.load(s_ptr + slots * sstride_s + kh, mask=valid, other=0.0)
        x = x * sc[:, None]
    return x.to(OUT)


@triton.jit
def _slots(table_ptr, kpos, valid, BLOCK_SIZE: tl.constexpr):
    """Cache slots of positions ``kpos`` of the sequence whose block table row starts at table_ptr."""
    block = tl.load(table_ptr + kpos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * BLOCK_SIZE + kpos % BLOCK_SIZE


@triton.jit
def _attend_block(q, k, v, s_mask, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """One online-softmax update of (m_i, l_i, acc) with keys k and values v ([BLOCK_N, BLOCK_D]).
    IEEE: exact float32 dots (float32 models, and the interpreter, whose bf16 dot is wrong)."""
    if IEEE:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(s_mask, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, o_ptr, scale,
                   stride_qt, stride_qh, stride_ks, stride_kh, stride_ss, stride_bt, stride_ot, stride_oh,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KIND: tl.constexpr, IEEE: tl.constexpr):
    # One program per (sequence, kv head): the G query heads sharing that kv head are the tile's rows.
    b = tl.program_id(0)
    kh = tl.program_id(1)
    length = tl.load(lens_ptr + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < G
    dmask = d < D
    heads = kh * G + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for j in range(0, tl.cdiv(length, BLOCK_N)):
        kpos = j * BLOCK_N + offs
        valid = kpos < length
        slots = _slots(bt_ptr + b * stride_bt, kpos, valid, BLOCK_SIZE)
        k = _load_kv(k_ptr, ks_ptr, slots, kh, d, valid, dmask, stride_ks, stride_kh, stride_ss,
                     KIND, q_ptr.dtype.element_ty)
        v = _load_kv(v_ptr, vs_ptr, slots, kh, d, valid, dmask, stride_ks, stride_kh, stride_ss,
                     KIND, q_ptr.dtype.element_ty)
        m_i, l_i, acc = _attend_block(q, k, v, valid[None, :], m_i, l_i, acc, scale, IEEE)
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(o_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, t_seq_ptr, t_start_ptr, t_count_ptr,
                    t_pos_ptr, o_ptr, scale,
                    stride_qt, stride_qh, stride_ks, stride_kh, stride_ss, stride_bt, stride_ot, stride_oh,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KIND: tl.constexpr, IEEE: tl.constexpr):
    # One program per (tile of up to BLOCK_M consecutive prompt tokens of one sequence, query head).
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // G
    seq = tl.load(t_seq_ptr + tile)
    start = tl.load(t_start_ptr + tile)
    count = tl.load(t_count_ptr + tile)
    pos0 = tl.load(t_pos_ptr + tile)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mmask = m < count
    dmask = d < D
    rows = (start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    qpos = pos0 + m
    kv_len = pos0 + count
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for j in range(0, tl.cdiv(kv_len, BLOCK_N)):
        kpos = j * BLOCK_N + offs
        valid = kpos < kv_len
        slots = _slots(bt_ptr + seq * stride_bt, kpos, valid, BLOCK_SIZE)
        k = _load_kv(k_ptr, ks_ptr, slots, kh, d, valid, dmask, stride_ks, stride_kh, stride_ss,
                     KIND, q_ptr.dtype.element_ty)
        v = _load_kv(v_ptr, vs_ptr, slots, kh, d, valid, dmask, stride_ks, stride_kh, stride_ss,
                     KIND, q_ptr.dtype.element_ty)
        causal = (kpos[None, :] <= qpos[:, None]) & valid[None, :]
        m_i, l_i, acc = _attend_block(q, k, v, causal, m_i, l_i, acc, scale, IEEE)
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def _tile(block_size: int) -> int:
    """Keys per loop iteration: several cache blocks at once (fewer dependent iterations per program)."""
    return max(KEYS_PER_TILE, block_size)


def _check(q: torch.Tensor, cache: CacheTensors, block_size: int) -> tuple[int, int, int]:
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = cache.k.shape[1]
    if heads % kv_heads or q.stride(2) != 1 or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"paged attention needs heads ({heads}) a multiple of kv heads ({kv_heads}), "
                         f"unit stride on head_dim and a power-of-two block size (got {block_size})")
    return heads // kv_heads, head_dim, max(16, triton.next_power_of_2(head_dim))  # tl.dot needs >= 16


def paged_decode_attention(q: torch.Tensor, cache: CacheTensors, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, block_size: int, out: torch.Tensor) -> None:
    """out[b] = attention of q[b] ([B, H, D], one token per sequence) over the first seq_lens[b]
    tokens of sequence b's cache. seq_lens: [B] int32; out: [B, H, D], written in place."""
    group, head_dim, block_d = _check(q, cache, block_size)
    ks, vs = scale_args(cache)
    grid = (q.shape[0], cache.k.shape[1])
    _decode_kernel[grid](
        q, cache.k, cache.v, ks, vs, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), cache.k.stride(0), cache.k.stride(1), ks.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=_tile(block_size), KIND=cache.kind,
        IEEE=_INTERPRETED or q.dtype == torch.float32, **FUSED)


def paged_prefill_attention(q: torch.Tensor, cache: CacheTensors, block_tables: torch.Tensor,
                            tiles: PrefillTiles, scale: float, block_size: int, out: torch.Tensor) -> None:
    """For each tile's tokens (rows of q [T, H, D]), causal attention over their sequence's cache up to
    their own position (the chunk's k/v are already written). Writes those rows of out [T, H, D]."""
    group, head_dim, block_d = _check(q, cache, block_size)
    if tiles.num_tiles == 0:
        return
    ks, vs = scale_args(cache)
    grid = (tiles.num_tiles, q.shape[1])
    _prefill_kernel[grid](
        q, cache.k, cache.v, ks, vs, block_tables, tiles.seq, tiles.start, tiles.count, tiles.pos0, out, scale,
        q.stride(0), q.stride(1), cache.k.stride(0), cache.k.stride(1), ks.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=group, D=head_dim, BLOCK_D=block_d, BLOCK_M=PREFILL_BLOCK_M, BLOCK_SIZE=block_size,
        BLOCK_N=_tile(block_size), KIND=cache.kind, IEEE=_INTERPRETED or q.dtype == torch.float32, **FUSED)
