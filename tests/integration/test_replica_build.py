"""What a replica builds from the settings. It resolves its codecs before it builds its engine: an explicit
policy without any engine, "auto" by calibrating on a throwaway engine whose KV pool holds just the
calibration prompts (no pool sized from a GPU's free memory, no CUDA graphs), which picks what calibrating on
a full-size engine picks. A prefill worker's sender gets the transfer settings."""

from __future__ import annotations

import pytest

from controlplane.pools.replica import build_worker, calibration_prompts, resolve_pool_codecs, security_for
from controlplane.settings import Settings
from workers.prefill.calibrate import resolve_codecs
from workers.runtime.engine import Engine

pytestmark = [pytest.mark.integration]


def test_auto_calibrates_on_a_small_engine_as_on_a_full_one(default_bundle) -> None:
    pool = Settings.load(None, {}).prefill
    full = Engine(default_bundle.model, default_bundle.tokenizer, pool.engine.engine_config(),
                  default_bundle.eos_token_ids)
    want = resolve_codecs("auto", full, calibration_prompts(default_bundle, pool.engine.block_size)).codecs
    got = resolve_pool_codecs("auto", default_bundle, pool)
    assert got == want and len(got) == default_bundle.config.num_layers


def test_an_explicit_policy_is_resolved_per_layer(default_bundle) -> None:
    pool = Settings.load(None, {}).prefill
    assert resolve_pool_codecs("int8,0=bf16,-1=bf16", default_bundle, pool) == ("bf16", "int8", "int8", "bf16")


def test_a_prefill_worker_sends_within_the_transfer_settings(default_ckpt) -> None:
    settings = Settings.load(None, {"transfer": {"timeout_s": 7.5, "stream_budget_bytes": 3 * 2**20,
                                                 "sender_budget_bytes": 5 * 2**20}})
    worker = build_worker("prefill", settings, default_ckpt, security_for(settings, "t" * 24), "127.0.0.1")
    try:
        sender = worker.service.sender  # type: ignore[attr-defined]  # a prefill worker's service has one
        assert sender.max_timeout_s == 7.5 and sender.budget.capacity == 5 * 2**20
        assert sender.sizes.stream_budget == 3 * 2**20
    finally:
        worker.stop()
