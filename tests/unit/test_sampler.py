"""SamplingParams validation and the batched sampler: greedy, top-k, top-p, seeds, batch invariance."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from workers.runtime.errors import InvalidRequestError
from workers.runtime.sampler import (
    GREEDY_BELOW,
    TOP_P_CANDIDATES,
    SamplingParams,
    _apply_top_k_top_p,
    _inverse_cdf,
    draw_seed,
    sample,
    seed_draw,
    token_logprobs,
)

pytestmark = [pytest.mark.unit]

VOCAB = 64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=_gen(seed)) * 3


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    gen = _gen(seed)
    return [sample(logits_row[None, :], [params], [gen])[0] for _ in range(n)]


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.01}, "temperature"),
    ({"temperature": 1000.0}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"stop": tuple(str(i) for i in range(17))}, "stop"),
    ({"stop": ("x" * 257,)}, "stop"),
    ({"stop": (3,)}, "stop"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
])
def test_invalid_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"^{field} must"):
        SamplingParams(**kwargs)


def test_boundary_params_are_accepted() -> None:
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=2**63 - 1,
                       stop=tuple("x" * 256 for _ in range(16)))
    assert p.greedy
    assert not SamplingParams(temperature=1e-3).greedy


# ---------------------------------------------------------------- greedy and degenerate filters
def test_greedy_picks_argmax_and_consumes_no_randomness() -> None:
    logits = _logits(5)
    gens = [_gen(i) for i in range(5)]
    before = [g.get_state() for g in gens]
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5, gens)
    assert out == logits.argmax(-1).tolist()
    assert all(isinstance(t, int) for t in out)
    assert all(torch.equal(b, g.get_state()) for b, g in zip(before, gens))


@pytest.mark.parametrize("temperature", [0.05, 1.0, 7.0, 100.0])
def test_top_k_1_is_argmax_at_any_temperature(temperature: float) -> None:
    logits = _logits(8, seed=1)
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(8)]
    for step in range(20):
        assert sample(logits, params, [_gen(step * 8 + i) for i in range(8)]) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 100.0])
def test_tiny_top_p_is_argmax(temperature: float) -> None:
    logits = _logits(8, seed=2)
    params = [SamplingParams(temperature=temperature, top_p=1e-6) for _ in range(8)]
    for step in range(20):
        assert sample(logits, params, [_gen(step * 8 + i) for i in range(8)]) == logits.argmax(-1).tolist()


# ---------------------------------------------------------------- seeds and batch invariance
def test_same_seed_same_draws_different_seed_different_draws() -> None:
    row = torch.zeros(VOCAB)  # uniform: draws are pure randomness
    p = SamplingParams(temperature=1.0)
    a, b, c = _draws(row, p, 50, seed=7), _draws(row, p, 50, seed=7), _draws(row, p, 50, seed=8)
    assert a == b
    assert a != c
    assert len(set(a)) > 10


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.3, top_k=7, seed=12),
    SamplingParams(temperature=1.0, top_p=0.6, seed=13),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=14),
], ids=["plain", "top_k", "top_p", "both"])
def test_seeded_row_is_batch_invariant(target: SamplingParams) -> None:
    neighbours = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=3, seed=1),
                  SamplingParams(temperature=0.5, top_p=0.3, seed=2), SamplingParams(temperature=1.0, seed=3)]
    steps = 40
    logits = [_logits(5, seed=100 + s) for s in range(steps)]
    assert target.seed is not None
    # alone
    gen = _gen(target.seed)
    alone = [sample(row[2:3], [target], [gen])[0] for row in logits]
    # in the middle of a batch, with neighbours that do and do not filter
    gens = [_gen(1000 + i) for i in range(5)]
    gens[2] = _gen(target.seed)
    params = neighbours[:2] + [target] + neighbours[2:]
    batched = [sample(row, params, gens)[2] for row in logits]
    assert batched == alone
    assert len(set(alone)) > 3  # really sampling, not stuck on one token


# ---------------------------------------------------------------- filters and distributions
def test_top_k_draws_stay_in_top_k() -> None:
    row = (torch.randn(VOCAB, generator=_gen(5)) * 0.5).clamp(max=1.0)  # the tail: well below the top 5
    top = torch.tensor([3.0, 2.9, 2.8, 2.7, 2.6])
    order = torch.randperm(VOCAB, generator=_gen(6))
    row[order[:5]] = top
    top_set = set(order[:5].tolist())
    filtered = Counter(_draws(row, SamplingParams(temperature=1.5, top_k=5), 1500))
    assert set(filtered) == top_set  # only the top 5, and every one of them
    unfiltered = Counter(_draws(row, SamplingParams(temperature=1.5), 1500))
    assert set(unfiltered) - top_set  # the test can tell: without top_k the tail is drawn


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    row = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    counts = Counter(_draws(row, SamplingParams(temperature=1.0, top_p=0.7), 4000))
    assert set(counts) == {1, 3}  # 0.5 < 0.7, 0.5 + 0.3 reaches it; the rest is cut
    assert counts[1] / 4000 == pytest.approx(0.5 / 0.8, abs=0.03)


@pytest.mark.parametrize("temperature,expected", [
    (1.0, [0.7, 0.2, 0.1]),
    (0.5, [0.49 / 0.54, 0.04 / 0.54, 0.01 / 0.54]),  # p ** (1 / T), renormalised
    (2.0, [x / sum(p ** 0.5 for p in (0.7, 0.2, 0.1)) for x in (0.7 ** 0.5, 0.2 ** 0.5, 0.1 ** 0.5)]),
])
def test_temperature_distribution(temperature: float, expected: list[float]) -> None:
    row = torch.tensor([0.7, 0.2, 0.1]).log()
    n = 4000
    counts = Counter(_draws(row, SamplingParams(temperature=temperature), n, seed=3))
    for token, p in enumerate(expected):
        assert counts[token] / n == pytest.approx(p, abs=0.03)


def test_each_draw_has_its_own_seed_from_the_request_seed_and_the_token_index() -> None:
    seeds = [draw_seed(s, i) for s in (0, 1, 2, 2**63 - 1) for i in range(500)]
    assert all(0 <= x < 2**63 for x in seeds)
    assert len(set(seeds)) == len(seeds), "two draws of these requests would share a seed"
    assert draw_seed(7, 3) == draw_seed(7, 3)
    row = _logits(1, seed=5)[0]
    p = SamplingParams(temperature=1.0)
    a, b = torch.Generator(), torch.Generator()
    seed_draw(a, 7, 3)
    seed_draw(b, 7, 3)
    assert sample(row[None], [p], [a]) == sample(row[None], [p], [b])


def test_a_temperature_below_the_greedy_threshold_is_greedy() -> None:
    logits = _logits(3, seed=9)
    params = [SamplingParams(temperature=t, seed=1) for t in (1e-38, 1e-45, GREEDY_BELOW / 2)]
    assert all(p.greedy for p in params) and not SamplingParams(temperature=GREEDY_BELOW).greedy
    assert sample(logits, params, [_gen(1)] * 3) == logits.argmax(dim=-1).tolist()


def test_a_row_whose_logits_are_not_finite_does_not_fail_the_others() -> None:
    logits = _logits(3, seed=10)
    logits[1, 7] = float("inf")
    logits[2, 3] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=5)] * 3
    got = sample(logits, params, [_gen(5), _gen(5), _gen(5)])
    alone = sample(logits[:1], params[:1], [_gen(5)])
    assert got[0] == alone[0]  # the finite row is sampled as it would be alone
    assert got[1] == 7 and 0 <= got[2] < VOCAB


# ---------------------------------------------------------------- cuts by value, on large vocabularies
def _kept_by_definition(row: list[float], top_k: int, top_p: float) -> set[int]:
    """The documented filters, by brute force: top_k keeps logits >= the k-th largest; top_p keeps, in order
    of falling logit, tokens while the mass before them is below p, and every token equal to the last kept."""
    vocab = len(row)
    kth = sorted(row, reverse=True)[top_k - 1] if 0 < top_k < vocab else -math.inf
    kept = [x for x in row if x >= kth]
    if top_p < 1.0:
        top = max(kept)
        weights = sorted((math.exp(x - top) for x in kept), reverse=True)
        total, before, last = sum(weights), 0.0, 0
        for i, w in enumerate(weights):
            if before / total >= top_p:
                break
            last, before = i, before + w
        kth = max(kth, top + math.log(weights[last]))
    return {i for i, x in enumerate(row) if x >= kth - 1e-4}


@pytest.mark.parametrize("vocab", [50, 5000])
def test_filters_keep_what_the_definition_keeps_with_ties_and_flat_rows(vocab: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits on a coarse grid (many ties, as bf16 logits have), some rows flat enough that top_p's cut lies past
    the first TOP_P_CANDIDATES tokens (the full-sort path), against the definition worked out in Python."""
    import workers.runtime.sampler as sampler

    looked_at = []  # candidates per call
    thresholds = sampler._thresholds

    def spy(x: torch.Tensor, *args: Any) -> torch.Tensor:
        looked_at.append(args[3])
        return thresholds(x, *args)
    monkeypatch.setattr(sampler, "_thresholds", spy)
    g = _gen(21)
    rows, cases = [], []
    for i in range(24):
        scale = 0.2 if i % 2 == 0 else 3.0  # flat and peaked rows
        rows.append((torch.randn(vocab, generator=g) * scale * 4).round() / 4)
        cases.append(([0, 1, 5, 40, vocab][i // 2 % 5], [1.0, 0.95, 0.5, 1e-3][i // 2 % 4]))
    x = torch.stack(rows)
    got = _apply_top_k_top_p(x, [k for k, _ in cases], [p for _, p in cases])
    for row, kept_row, (k, p) in zip(x, got, cases):
        kept = set(torch.isfinite(kept_row).nonzero().squeeze(1).tolist())
        assert kept == _kept_by_definition(row.tolist(), k, p), (k, p)
        assert torch.equal(kept_row[list(kept)], row[list(kept)])
    # the large vocabulary looks among TOP_P_CANDIDATES first, and the flat rows are sorted in full again
    assert looked_at == ([TOP_P_CANDIDATES, vocab] if vocab >= 4 * TOP_P_CANDIDATES else [vocab])


def test_a_row_whose_cut_lies_past_the_candidates_is_batch_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = 4 * TOP_P_CANDIDATES
    flat, peaked = torch.randn(vocab, generator=_gen(3)) * 0.1, torch.randn(vocab, generator=_gen(4)) * 4
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=9)
    others = [SamplingParams(temperature=0.7, top_k=30, seed=1), SamplingParams(temperature=0.0)]

    def draws() -> tuple[list[int], list[int]]:
        alone = [sample(flat[None], [p], [_gen(s)])[0] for s in range(30)]
        rows = torch.stack([peaked, flat, peaked])
        batched = [sample(rows, [others[0], p, others[1]], [_gen(0), _gen(s), _gen(0)])[1] for s in range(30)]
        return alone, batched
    alone, batched = draws()
    assert alone == batched and len(set(alone)) > 20
    monkeypatch.setattr("workers.runtime.sampler.TOP_P_CANDIDATES", vocab)  # every row sorted in full
    assert draws() == (alone, batched)


def test_the_draw_never_lands_on_a_token_without_mass() -> None:
    x = torch.tensor([[float("-inf"), 0.0, 1.0, float("-inf"), float("-inf")]] * 3)
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    drawn, usable = _inverse_cdf(x, u)
    assert drawn.tolist() == [1, 2, 2] and usable.all()
    drawn, usable = _inverse_cdf(torch.tensor([[0.0, float("nan")], [float("inf"), 0.0]]), u[:2])
    assert not usable.any()


# ---------------------------------------------------------------- logprobs
def test_token_logprobs_are_each_rows_own_log_softmax_with_as_many_top_tokens_as_asked() -> None:
    logits = _logits(4)
    tokens = [5, 9, 11, 60]
    got = token_logprobs(logits, tokens, [3, None, 0, 20])
    assert got[1] is None
    for row, n in ((0, 3), (2, 0), (3, 20)):
        entry = got[row]
        assert entry is not None
        lp = torch.log_softmax(logits[row], dim=-1)
        assert entry.logprob == lp[tokens[row]].item()
        top = lp.topk(n) if n else None
        assert [i for i, _ in entry.top] == ([] if top is None else top.indices.tolist())
        assert [v for _, v in entry.top] == ([] if top is None else top.values.tolist())
    alone = token_logprobs(logits[3:4], tokens[3:], [20])[0]  # the same whatever shares the batch
    assert alone == got[3]


def test_no_row_asking_for_logprobs_costs_nothing() -> None:
    assert token_logprobs(torch.full((2, VOCAB), math.nan), [0, 1], [None, None]) == [None, None]


def test_a_row_whose_logits_are_not_finite_reads_minus_infinity_not_nan() -> None:
    logits = _logits(2)
    logits[1, 3] = math.nan
    got = token_logprobs(logits, [3, 3], [2, 2])
    assert got[0] is not None and math.isfinite(got[0].logprob)
    assert got[1] is not None and got[1].logprob == -math.inf
    assert not any(math.isnan(v) for _, v in got[1].top)
