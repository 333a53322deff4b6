"""Accuracy of quantised KV transfer end to end: 64 prompts x 64 greedy tokens through the real
transfer, against the bf16 transfer. The demo model has random weights, so its logits have no
semantic margin and near-ties are common; one flipped near-tie changes every later token, which
is why the free-running figure is the strict one. Figures are printed for the README."""

from __future__ import annotations

import pytest

from bench.kv_accuracy import agreement, sample_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_int8_and_fp8_agree_with_the_bf16_path(default_bundle, capsys):
    prompts = sample_prompts(default_bundle, 64)
    results = {a.policy: a for a in agreement(default_bundle, ["int8", "fp8"], prompts, max_tokens=64)}
    with capsys.disabled():
        for a in results.values():
            print(f"\n{a.policy}: free-running {a.free_running:.4f}, teacher-forced {a.teacher_forced:.4f}, "
                  f"{a.diverged}/64 sequences diverged")
    assert results["int8"].free_running >= 0.98
    assert results["int8"].teacher_forced >= 0.995
    # fp8 e4m3 keeps 3 mantissa bits; per decision it still agrees >= 98% (its free-running figure on
    # this random model is below 98%, stated in the README)
    assert results["fp8"].teacher_forced >= 0.98
    assert results["fp8"].free_running > 0.85
