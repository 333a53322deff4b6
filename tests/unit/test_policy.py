"""Codec policies: parsing, per-layer resolution, and auto calibration against an error budget."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.codecs import Kind
from kvtransfer.policy import (
    AUTO_CANDIDATES,
    CALIBRATION_MARGIN,
    AutoPolicy,
    ExplicitPolicy,
    PolicyError,
    calibrate,
    parse_policy,
    relative_error,
)
from workers.prefill.calibrate import resolve_codecs
from workers.runtime.engine import Engine, EngineConfig

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize("spec, layers, expected", [
    ("int8", 3, ("int8", "int8", "int8")),
    ("int8,0=bf16,-1=bf16", 4, ("bf16", "int8", "int8", "bf16")),
    (" fp8 , 1=int4 ", 3, ("fp8", "int4", "fp8")),
    ("fp32", 2, ("fp32", "fp32")),
])
def test_explicit_policies_resolve_per_layer(spec, layers, expected):
    policy = parse_policy(spec)
    assert isinstance(policy, ExplicitPolicy)
    assert policy.resolve(layers) == expected


@pytest.mark.parametrize("spec, message", [
    ("", "must start with a default codec"),
    ("0=bf16", "must start with a default codec"),
    ("int2", "unknown codec 'int2'"),
    ("int8,x=bf16", "is not LAYER=CODEC"),
    ("int8,3", "is not LAYER=CODEC"),
    ("int8,0=nope", "unknown codec 'nope'"),
    ("auto:abc", "must be a number"),
    ("auto:1.5", "must be in (0, 1)"),
])
def test_bad_policies_are_refused_with_the_reason(spec, message):
    with pytest.raises(PolicyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_policy(spec)


def test_an_override_outside_the_model_is_refused():
    with pytest.raises(PolicyError, match="names layer 7, but the model has 4 layers"):
        parse_policy("int8,7=bf16").resolve(4)


def test_auto_parses_its_budget():
    assert parse_policy("auto") == AutoPolicy()
    assert parse_policy("auto:0.05") == AutoPolicy(0.05)


def _kv(scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 16, 2, 64, generator=g) * scale, torch.randn(4, 16, 2, 64, generator=g) * scale


def test_calibration_picks_the_cheapest_codec_under_the_budget():
    samples = [[_kv(1.0, 0)], [_kv(1.0, 1)]]
    # outliers in one channel ruin per-block int8/fp8 but leave bf16 fine
    k, v = _kv(1.0, 2)
    k[..., 3] *= 1000.0
    samples.append([(k, v)])
    for budget in (0.003, 0.02, 0.2):
        result = calibrate(samples, AutoPolicy(budget))
        for layer, (codec, errors) in enumerate(zip(result.codecs, result.errors)):
            assert errors[codec] <= budget * CALIBRATION_MARGIN
            cheaper = AUTO_CANDIDATES[:AUTO_CANDIDATES.index(codec)]
            assert all(errors[c] > budget * CALIBRATION_MARGIN for c in cheaper), (layer, errors)
    assert calibrate(samples, AutoPolicy(0.2)).codecs[0] == "int4"
    assert calibrate(samples, AutoPolicy(0.003)).codecs[0] in ("bf16", "fp32")


def test_relative_error_is_zero_for_lossless_and_ordered_for_lossy():
    k, _ = _kv(3.0, 5)
    assert relative_error("fp32", k, Kind.KEY) == 0.0
    errs = {c: relative_error(c, k, Kind.KEY) for c in ("bf16", "int8", "fp8", "int4")}
    assert errs["bf16"] < errs["int8"] < errs["int4"] and errs["bf16"] < errs["fp8"] < errs["int4"]


def test_auto_on_an_engine_meets_its_budget_on_unseen_prompts(default_bundle):
    engine = Engine(default_bundle.model, default_bundle.tokenizer, EngineConfig())
    tok = default_bundle.tokenizer
    calibration_prompts = [tok.encode(t * 5) for t in ("The quick brown fox jumps over the lazy dog. ",
                                                       "Prefill writes the key and value cache. ")]
    unseen = [tok.encode(t * 6) for t in ("Hello, world. What is the capital of France? ",
                                          "One, two, three, four, five, six, seven. ")]
    for budget in (0.02, 0.1):
        result = resolve_codecs(f"auto:{budget}", engine, calibration_prompts)
        from workers.prefill.calibrate import sample_kv
        held_out = sample_kv(engine, unseen)
        for layer, codec in enumerate(result.codecs):
            worst = max(max(relative_error(codec, k, Kind.KEY), relative_error(codec, v, Kind.VALUE))
                        for k, v in held_out[layer])
            assert worst <= budget, f"layer {layer} codec {codec}: {worst} over the budget {budget}"
    assert resolve_codecs("auto:0.2", engine, calibration_prompts).codecs != resolve_codecs(
        "auto:0.005", engine, calibration_prompts).codecs
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total and stats.num_running == 0
