"""Fused elementwise kernels in Triton: RMSNorm (with the residual add), RoPE, SiLU·mul.

Each rounds its intermediates to the activation dtype where the torch path in ``model.py`` /
``rope.py`` does, so float32 results match it to rounding and bf16 results to one bf16 ulp. They are
launched with ``enable_fp_fusion=False`` and divide with ``div_rn``: no fused multiply-add and no
approximate division, so each product and quotient rounds as torch's does.
All take and return tensors whose last dimension has unit stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Launch options of the kernels that must round as torch does: no fused multiply-add.
EXACT = {"enable_fp_fusion": False}

@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, o_ptr, n, eps, stride_x, stride_r, stride_h, stride_o,
                    BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + row * stride_x + i, mask=mask, other=0.0)
    if RESIDUAL:
        # h = residual + x, rounded to the activation dtype as the torch add is.
        x = (tl.load(r_ptr + row * stride_r + i, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32))
        x = x.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + i, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.math.div_rn(tl.sum(x32 * x32, 0), n.to(tl.float32))
    y = (x32 * tl.math.rsqrt(var + eps)).to(o_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + i, (w * y).to(o_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) over the last dim of x [T, hidden] (a new tensor)."""
    out = torch.empty_like(x)
    if x.shape[0]:
        _rmsnorm_kernel[(x.shape[0],)](x, x, weight, x, out, x.shape[1], eps, x.stride(0), 0, 0, out.stride(0),
                                       BLOCK=triton.next_power_of_2(x.shape[1]), RESIDUAL=False, **EXACT)
    return out


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, weight * normalise(h)) with h = residual + x; both [T, hidden], new tensors."""
    h = torch.empty_like(residual)
    out = torch.empty_like(residual)
    if x.shape[0]:
        _rmsnorm_kernel[(x.shape[0],)](x, residual, weight, h, out, x.shape[1], eps, x.stride(0),
                                       residual.stride(0), h.stride(0), out.stride(0),
                                       BLOCK=triton.next_power_of_2(x.shape[1]), RESIDUAL=True, **EXACT)
    return h, out


@triton.jit
def rotate(x1, x2, c1, c2, s1, s2, dt: tl.constexpr):
    """RoPE of one head's halves (x1, x2) with float32 cos/sin halves, each product and the sum rounded
    to ``dt`` as the torch path's ``x * cos + rotated * sin`` in ``dt`` is."""
    a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
    # -(x2 * s1), the same bits as (-x2) * s1; not a unary minus, which triton < 3.7 lowers to 0 - x (+0 for -0)
    b1 = (x2.to(tl.float32) * s1 * -1.0).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    return (a1 + b1).to(dt), (a2 + b2).to(dt)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct,
                 HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + i, mask=mask, other=0.0)
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + i, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + i, mask=mask, other=0.0).to(tl.float32)
    lo, hi = rotate(x1, x2, c1, c2, s1, s2, x_ptr.dtype.element_ty)
    tl.store(base + i, lo, mask=mask)
    tl.store(base + HALF + i, hi, mask=mask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place by cos, sin ([T, 1, head_dim], x's dtype); returns x."""
    tokens, heads, head_dim = x.shape
    if tokens:
        half = head_dim // 2
        _rope_kernel[(tokens, heads)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                                      HALF=half, BLOCK=triton.next_power_of_2(half), **EXACT)
    return x


@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    g = tl.load(x_ptr + row * stride_x + i, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + i, mask=mask, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    s = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dt).to(tl.float32)
    tl.store(o_ptr + row * stride_o + i, (s * u).to(dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * I] laid out as [gate | up]; returns [T, I]."""
    n = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0),
                                                                    out.stride(0), BLOCK=block, **EXACT)
    return out
