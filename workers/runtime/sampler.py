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

MAX_LOGPROBS = 20  # the most top_logprobs a request may ask for (OpenAI's chat limit; vLLM's default max_logprobs)

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
    # max_tokens is a ceiling the client did not set (a chat without max_tokens: "the rest of the context"):
    # an engine whose KV pool holds less than prompt + max_tokens runs the request as far as its pool holds
    # (finishing "length" there) instead of refusing it
    to_context: bool = False
    return_logits: bool = False  # attach each step's float32 logits to the output (tests)
    # Each output token's log-probability, and (n > 0) the n most likely tokens', under the model's own
    # distribution (log_softmax of the raw logits, before temperature, top-k and top-p, as vLLM reports them).
    # None = off; 0 = the chosen token's alone.
    logprobs: int | None = None
    # The same for each prompt token after the first (from the logits at the position before it), sent with
    # the first output token. None = off.
    prompt_logprobs: int | None = None
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
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {n!r}")
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


# A top-p row without top_k first looks for its cut among this many of its most likely tokens; only a row whose
# candidates all fall inside the cut is sorted in full. The result is the same either way. Vocabularies under
# four times this are sorted in full at once.
TOP_P_CANDIDATES = 1024


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """Pick one token per row of ``logits`` [n, vocab] (float32).

    Everything runs on the logits' device and the host reads the tokens once. Each sampled row takes one
    uniform number from its own (CPU) generator and draws by inverse CDF over its filtered distribution in
    token-id order, so a seeded request draws the same token from the same logits whatever else shares the
    batch. A row whose logits are not finite keeps its argmax: one row must not fail the batch."""
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out.tolist()
    device = logits.device
    picked = [params[i] for i in rows]
    index = _on(device, torch.tensor(rows))
    x = logits.index_select(0, index) / _on(device, torch.tensor([p.temperature for p in picked]))[:, None]
    if any(p.top_k or p.top_p < 1.0 for p in picked):
        x = _apply_top_k_top_p(x, [p.top_k for p in picked], [p.top_p for p in picked])
    u = _on(device, torch.stack([torch.rand((), dtype=torch.float64, generator=generators[i]) for i in rows]))
    drawn, usable = _inverse_cdf(x, u)
    out[index] = torch.where(usable, drawn, out[index])
    return out.tolist()


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability and the ``top`` (token id, log-probability) pairs, most likely first
    (empty when the request asked for logprobs 0)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], wanted: list[int | None]) -> list[TokenLogprobs | None]:
    """For each row of ``logits`` [n, vocab] (float32) whose ``wanted`` is not None: the log-probability of
    ``tokens[row]`` and of the ``wanted[row]`` most likely tokens (log_softmax over the row, so each row's figures
    are its own whatever shares the batch). At most two reads from the device, however many rows. A row whose logits
    are not finite (``sample`` keeps its argmax) reads -inf where log_softmax gives NaN."""
    rows = [i for i, w in enumerate(wanted) if w is not None]
    out: list[TokenLogprobs | None] = [None] * len(wanted)
    if not rows:
        return out
    device = logits.device
    lp = torch.log_softmax(logits.index_select(0, _on(device, torch.tensor(rows))).float(), dim=-1)
    lp = torch.nan_to_num(lp, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    chosen = lp.gather(1, _on(device, torch.tensor([[tokens[i]] for i in rows])))
    k = max(wanted[i] or 0 for i in rows)
    if k:
        top = lp.topk(min(k, lp.shape[-1]), dim=-1)
        figures, ids = torch.cat((chosen, top.values), dim=1).tolist(), top.indices.tolist()
    else:
        figures = chosen.tolist()
    for j, i in enumerate(rows):
        n = wanted[i] or 0
        row = figures[j]
        out[i] = TokenLogprobs(row[0], tuple(zip(ids[j][:n], row[1:n + 1])) if n else ())
    return out


def _on(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """A small host tensor on ``device``; to a GPU through pinned memory without waiting (a pageable copy
    would first wait for the step's forward to finish, leaving the GPU idle while sampling launches)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _inverse_cdf(x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of logits ``x``, the token whose CDF interval (in token-id order) holds ``u`` times the
    row's mass (``u`` in [0, 1)), and whether the row's probabilities are finite. The CDF is summed in
    float64; a token of zero probability is never drawn."""
    cdf = torch.softmax(x, dim=-1).double().cumsum(dim=-1)
    total = cdf[:, -1:]  # NaN when any probability is (softmax gives NaN, never inf)
    # u <= 1 - 2^-53, so u * total rounds below total: the first index whose CDF passes it is a token with mass
    drawn = torch.searchsorted(cdf, u[:, None] * total, right=True).squeeze(1)
    return drawn, torch.isfinite(total[:, 0])


def _apply_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """``x`` with the tokens each row's filters drop set to -inf. top_k keeps the tokens whose logit is at least
    the k-th largest (ties at that value all stay); top_p then keeps the most likely tokens of what is left
    until their mass reaches p (the first token always stays, and so do ties at the last kept value). Both cut
    by value, so which of two equal logits comes first never changes the outcome."""
    vocab = x.shape[-1]
    device = x.device
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    cut_by_p = [p < 1.0 for p in top_p]  # top_p == 1 means off: never cut, even by float rounding
    first_look = TOP_P_CANDIDATES if vocab >= 4 * TOP_P_CANDIDATES else vocab
    need = max(k if k < vocab else (first_look if by_p else 1) for k, by_p in zip(ks, cut_by_p))
    threshold = _thresholds(x, _on(device, torch.tensor(ks)), _on(device, torch.tensor(top_p, dtype=torch.float64)),
                            _on(device, torch.tensor(cut_by_p)), need, any(cut_by_p))
    return x.masked_fill(x < threshold, float("-inf"))


def _thresholds(x: torch.Tensor, ks: torch.Tensor, top_p: torch.Tensor, cut_by_p: torch.Tensor,
                candidates: int, any_p: bool = True) -> torch.Tensor:
    """Each row's lowest kept logit [rows, 1], looking at its ``candidates`` largest logits; rows whose top_p cut
    may lie past them are done again over the whole row."""
    vocab = x.shape[-1]
    vals = x.topk(candidates, dim=-1).values  # sorted, largest first
    neg_inf = torch.full_like(vals[:, :1], float("-inf"))
    by_k = ks[:, None] < vocab
    kth = torch.where(by_k, vals.gather(1, (ks.clamp(max=candidates) - 1)[:, None]), neg_inf)
    if not any_p:
        return kth
    # The top-k filtered distribution, normalised over the whole row (ties at the k-th value may lie past
    # the candidates), read at the candidates in order.
    log_z = torch.logsumexp(x.masked_fill(x < kth, float("-inf")), dim=-1, keepdim=True)
    probs = torch.exp(vals - log_z).masked_fill(vals < kth, 0.0).double()
    mass_before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # exact prefix sums: monotone
    within = (mass_before < top_p[:, None]) & (vals >= kth)
    last = (within.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    tau = vals.gather(1, last)
    threshold = torch.where(cut_by_p[:, None], torch.maximum(tau, kth), kth)
    # A top_p row with no top_k whose every candidate is within the cut: its cut may lie further on.
    again = cut_by_p & ~by_k[:, 0] & within[:, -1] if candidates < vocab else None
    if again is not None and bool(again.any()):
        rows = again.nonzero().squeeze(1)
        threshold[rows] = _thresholds(x[rows], ks[rows], top_p[rows], cut_by_p[rows], vocab)
    return threshold
