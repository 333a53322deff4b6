"""Sampling parameters and the batched sampler.

Greedy rows take the argmax. Other rows apply temperature, top-k and top-p, then draw with the
sequence's own ``torch.Generator``, so a seeded request gives the same tokens whatever else is in
the batch. The engine seeds that generator afresh before each draw from the request's seed and the
output token's index (``seed_draw``), so a draw does not depend on the draws before it either: a
request whose first token was sampled by a prefill worker continues on a decode worker exactly as
it would have in one engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.runtime.errors import InvalidRequestError

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-38 overflows them to
# inf, and softmax then gives NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logits: bool = False  # attach each step's float32 logits to the output (tests, logprobs)
    # Teacher forcing: output token i is forced_tokens[i] whatever is sampled (with return_logits,
    # this scores a given continuation). Empty = off.
    forced_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if self.forced_tokens and len(self.forced_tokens) < self.max_tokens:
            raise InvalidRequestError("forced_tokens must hold at least max_tokens tokens")
        if len(self.stop) > 16 or any(not isinstance(s, str) or len(s) > 256 for s in self.stop):
            raise InvalidRequestError("stop must be at most 16 strings of at most 256 characters")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The seed of output token ``index``'s draw: splitmix64 over (seed, index), in [0, 2^63)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def seed_draw(generator: torch.Generator, seed: int, index: int) -> None:
    """Seed ``generator`` for output token ``index`` of a request seeded with ``seed``; the draw depends only
    on (seed, index), never on what else shares the batch."""
    generator.manual_seed(draw_seed(seed, index))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """Pick one token per row of ``logits`` [n, vocab] (float32)."""
    out = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    # The sampled rows move to the host (a no-op on CPU): the per-request generators are CPU ones, so a
    # seeded request draws the same token from the same logits on any device.
    x = logits[torch.tensor(rows, device=logits.device)].cpu()
    x = x / torch.tensor([params[i].temperature for i in rows], dtype=x.dtype)[:, None]
    if any(params[i].top_k or params[i].top_p < 1.0 for i in rows):
        x = _apply_top_k_top_p(x, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
    probs = torch.softmax(x, dim=-1)
    usable = torch.isfinite(probs).all(dim=-1).tolist()
    for j, i in enumerate(rows):
        if usable[j]:  # else (non-finite logits) the row keeps its argmax: one row must not fail the batch
            out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return out


def _apply_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
    ranks = torch.arange(vocab)[None, :]
    drop = ranks >= ks[:, None]
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, dtype=x.dtype)[:, None]
    drop |= (mass_before >= p) & (p < 1.0)  # top_p == 1 means off: never cut, even by float rounding
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
