"""Split-context paged decode attention (flash-decoding) for few sequences over long contexts.

With one program per (sequence, kv head), a batch of one walks its whole context in 4-8 programs
and leaves a large GPU idle. Here the context of each (sequence, kv head) is cut into ``splits``
ranges of key tiles, one program each; every program keeps its own online-softmax state (max, sum,
unnormalised output) in float32 scratch, and a second kernel merges them. Same contract as
``paged_decode_attention``: a length-0 row gives zeros, a split past a row's context does nothing.
``num_splits`` picks the split count from what the host knows (batch, kv heads, a bound on the
context), so a CUDA graph captured for a bound keeps it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.runtime.kernels.cache_views import CacheTensors, scale_args
from workers.runtime.kernels.paged_attention import _INTERPRETED, FUSED, _attend_block, _check, _load_kv, _slots, _tile

TARGET_PROGRAMS = 128  # about one wave of a large GPU's SMs
MAX_SPLITS = 16
MIN_TILES_TO_SPLIT = 9  # contexts of up to 8 key tiles (512 keys) are not split


def short_context(block_size: int = 16) -> int:
    """The longest context ``num_splits`` never splits, in tokens."""
    return (MIN_TILES_TO_SPLIT - 1) * _tile(block_size)


def num_splits(batch: int, kv_heads: int, max_context: int, block_size: int) -> int:
    """Splits per (sequence, kv head) for a batch whose contexts are at most ``max_context`` tokens."""
    tiles = -(-max_context // _tile(block_size))
    if tiles < MIN_TILES_TO_SPLIT:
        return 1
    want = -(-TARGET_PROGRAMS // (batch * kv_heads))
    return max(1, min(want, tiles // 2, MAX_SPLITS))


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, scale,
                  stride_qt, stride_qh, stride_ks, stride_kh, stride_ss, stride_bt,
                  H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, KIND: tl.constexpr,
                  IEEE: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    n_tiles = tl.cdiv(length, BLOCK_N)
    per = tl.cdiv(n_tiles, SPLITS)
    first = s * per
    last = tl.minimum(first + per, n_tiles)
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
    for j in range(first, last):
        kpos = j * BLOCK_N + offs
        valid = kpos < length
        slots = _slots(bt_ptr + b * stride_bt, kpos, valid, BLOCK_SIZE)
        k = _load_kv(k_ptr, ks_ptr, slots, kh, d, valid, dmask, stride_ks, stride_kh, stride_ss,
                     KIND, q_ptr.dtype.element_ty)
        v = _load_kv(v_ptr, vs_ptr, slots, kh, d, valid, dmask, stride_ks, stride_kh, stride_ss,
                     KIND, q_ptr.dtype.element_ty)
        m_i, l_i, acc = _attend_block(q, k, v, valid[None, :], m_i, l_i, acc, scale, IEEE)
    part = (b * H + heads) * SPLITS + s  # [BLOCK_G] rows of the [B, H, SPLITS] scratch
    tl.store(m_ptr + part, m_i, mask=gmask)
    tl.store(l_ptr + part, l_i, mask=gmask)
    tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, stride_ot, stride_oh, H: tl.constexpr, D: tl.constexpr,
                  BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < SPLITS
    part = (b * H + h) * SPLITS + s
    m = tl.load(m_ptr + part, mask=smask, other=float("-inf"))
    l_s = tl.load(l_ptr + part, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
    total = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0)
    out = tl.where(total > 0, out / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(o_ptr + b * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


def split_decode_attention(q: torch.Tensor, cache: CacheTensors, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, block_size: int, out: torch.Tensor, splits: int) -> None:
    """``paged_decode_attention`` with each row's context cut into ``splits`` ranges (>= 2)."""
    group, head_dim, block_d = _check(q, cache, block_size)
    batch, heads = q.shape[0], q.shape[1]
    ks, vs = scale_args(cache)
    m = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    acc = torch.empty((batch, heads, splits, block_d), dtype=torch.float32, device=q.device)
    _split_kernel[(batch, cache.k.shape[1], splits)](
        q, cache.k, cache.v, ks, vs, block_tables, seq_lens, m, lse, acc, scale,
        q.stride(0), q.stride(1), cache.k.stride(0), cache.k.stride(1), ks.stride(0), block_tables.stride(0),
        H=heads, G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=_tile(block_size), SPLITS=splits, KIND=cache.kind,
        IEEE=_INTERPRETED or q.dtype == torch.float32, **FUSED)
    _merge_kernel[(batch, heads)](m, lse, acc, out, out.stride(0), out.stride(1), H=heads, D=head_dim,
                                  BLOCK_D=block_d, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), **FUSED)
