"""The Llama-family decoder (Llama 2/3, Qwen2) over a paged KV cache.

Weights follow the HF layout except that q/k/v and gate/up are fused into one matmul each at load
time (fewer, larger matmuls are faster on CPU and GPU alike). Numerics follow transformers
(RMSNorm in float32, RoPE in float32) so float32 logits match HF to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from workers.runtime.attention import StepBatch, paged_attention
from workers.runtime.config import ModelConfig
from workers.runtime.devices import note_memory_baseline, resolve_device
from workers.runtime.fingerprint import module_fingerprint
from workers.runtime.kv_cache import KVLayerStorage, PagedKVCache
from workers.runtime.rope import RotaryEmbedding

if TYPE_CHECKING:
    from workers.runtime.kernels.ops import TritonOps

LayerDone = Callable[[int], None]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype, device: torch.device) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias, dtype=dtype, device=device)
    layer.requires_grad_(False)
    return layer


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = _linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias, dtype, device)
        self.o_proj = _linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias, dtype, device)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype, device)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch,
                storage: KVLayerStorage) -> torch.Tensor:
        cfg = self.cfg
        n = h.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(h))
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = RotaryEmbedding.apply(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
        k = RotaryEmbedding.apply(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        storage.write(batch.slot_mapping, k, v)
        attn = paged_attention(q, k, v, batch, storage, self.scale)
        h = h + self.o_proj(attn.view(n, cfg.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def forward_kernels(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                        sin: torch.Tensor, batch: StepBatch, storage: KVLayerStorage,
                        ops: TritonOps) -> tuple[torch.Tensor, torch.Tensor]:
        """The same computation with the fused kernels. The residual stream is carried apart and each
        add is fused into the next RMSNorm: returns (this layer's MLP output, the residual before it),
        whose sum is what ``forward`` returns. RoPE runs in place on the qkv output, fused with the KV write."""
        cfg = self.cfg
        n = h.shape[0]
        ln = self.input_layernorm
        if residual is None:
            residual, x = h, ops.rmsnorm(h, ln.weight, ln.eps)
        else:
            residual, x = ops.add_rmsnorm(h, residual, ln.weight, ln.eps)
        qkv = self.qkv_proj(x)
        qk = qkv[:, :cfg.q_size + cfg.kv_size].view(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(n, cfg.num_kv_heads, cfg.head_dim)
        ops.rope_write_kv(storage, batch.slot_mapping, qk, v, cos, sin, cfg.num_heads)  # RoPE in place
        q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
        attn = ops.attention(q, k, v, batch, storage, self.scale)
        ln = self.post_attention_layernorm
        residual, x = ops.add_rmsnorm(self.o_proj(attn.view(n, cfg.q_size)), residual, ln.weight, ln.eps)
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x))), residual


class DecoderModel(nn.Module):
    """Embeddings, ``num_layers`` decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        device = resolve_device(device)
        note_memory_baseline(device)  # before the weights: what the GPU held then is not this engine's
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, device)

    def fingerprint(self) -> str:
        """A hash of the KV-relevant config and every weight: two workers can only exchange KV caches
        when their fingerprints are equal."""
        return module_fingerprint(self, self.cfg.model_type, self.cfg.fingerprint_fields())

    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: PagedKVCache, on_layer_done: LayerDone | None = None,
                ops: TritonOps | None = None, prompt_hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Run one step; returns float32 logits [S, vocab] of ``batch.logits_indices``. The final-normed hidden
        states of ``batch.prompt_logits_indices`` [P, hidden] are appended to ``prompt_hidden`` (which a batch
        with such rows needs): their logits are the caller's to take a slice at a time (``lm_logits``), as
        [P, vocab] at once could be gigabytes. With ``ops`` the
        layers run the Triton kernels (``batch`` then needs ``kernel`` for decodes and cached context).

        ``on_layer_done(i)`` is called after layer ``i`` has written this step's k/v to the cache,
        so a transfer can stream layer ``i`` while layer ``i + 1`` computes.
        """
        h = self.embed_tokens(batch.input_ids)
        if batch.embed_indices is not None and batch.embeds is not None:
            h[batch.embed_indices] = batch.embeds.to(h.dtype)
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        if ops is not None:
            return self._forward_kernels(h, cos, sin, batch, cache, on_layer_done, ops, prompt_hidden)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, batch, cache.layers[i])
            if on_layer_done is not None:
                on_layer_done(i)
        return self._logits(self.norm(h[batch.logit_rows()]), batch, prompt_hidden)

    def _forward_kernels(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch,
                         cache: PagedKVCache, on_layer_done: LayerDone | None, ops: TritonOps,
                         prompt_hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            h, residual = layer.forward_kernels(h, residual, cos, sin, batch, cache.layers[i], ops)
            if on_layer_done is not None:
                on_layer_done(i)
        assert residual is not None
        idx = batch.logit_rows()
        _, x = ops.add_rmsnorm(h[idx], residual[idx], self.norm.weight, self.norm.eps)
        return self._logits(x, batch, prompt_hidden)

    def _logits(self, x: torch.Tensor, batch: StepBatch, prompt_hidden: list[torch.Tensor] | None) -> torch.Tensor:
        """The sampled rows' logits from the final-normed ``x`` of ``batch.logit_rows()``; the prompt rows' go to
        ``prompt_hidden``."""
        if batch.prompt_logits_indices is not None:
            assert prompt_hidden is not None, "a batch with prompt logit rows needs prompt_hidden"
            sampled = len(batch.logits_indices)
            prompt_hidden.append(x[sampled:])
            x = x[:sampled]
        return self.lm_logits(x)

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden states ``x`` [n, hidden]."""
        return self.lm_head(x).float()
