"""``epd bench serve`` as a vLLM user runs it: vLLM's flag names, its flat result keys, and random prompts of
exactly ``--random-input-len`` tokens as the server counts them (through its /tokenize)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bench.serve.cli import config_from_args
from bench.serve.config import BenchInputError

if TYPE_CHECKING:  # the fixtures come from tests/e2e/conftest.py
    from conftest import Stack

pytestmark = [pytest.mark.e2e]
EPD = str(Path(sys.executable).with_name("epd"))


def _epd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EPD, "bench", "serve", *args], capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllm_flags_flat_keys_and_exact_prompt_lengths(e2e_stack: Stack, tmp_path: Path, endpoint: str):
    backend = "openai-chat" if endpoint == "chat" else "openai"
    run = _epd("--base-url", e2e_stack.base_url.removesuffix("/v1"), "--api-key", e2e_stack.api_key,
               "--backend", backend, "--dataset-name", "random", "--random-input-len", "40",
               "--random-output-len", "3", "--num-prompts", "6", "--request-rate", "inf", "--max-concurrency", "3",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99.9",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "run.json", "--disable-tqdm",
               "--ignore-eos")
    assert run.returncode == 0, run.stderr
    assert "note:" not in run.stderr, run.stderr  # the server's /tokenize was used: no fallback note
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["completed"] == 6 and data["num_prompts"] == 6 and data["max_concurrency"] == 3
    assert data["backend"] == backend and data["model_id"] == data["model"] and data["request_rate"] == "inf"
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for key in (f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", f"p50_{metric}_ms",
                    f"p99.9_{metric}_ms"):
            assert isinstance(data[key], float) and data[key] >= 0, key
    assert data["mean_ttft_ms"] == pytest.approx(data["points"][0]["ttft_ms"]["mean"])  # next to our own
    assert data["points"][0]["p50_ttft_ms"] == data["p50_ttft_ms"]
    assert data["points"][0]["request_rate"] == "inf"  # the same value as at the top, as vLLM spells it
    # exactly the asked length, as the server counted it in usage.prompt_tokens (chat: template included)
    assert data["input_lens"] == [40] * 6, data["input_lens"]
    assert data["output_lens"] == [3] * 6
    assert data["total_input_tokens"] == 240 and data["errors"] == [""] * 6


def _args(*argv: str):
    import argparse

    from bench.serve.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_defaults_to_localhost_8000_and_reads_vllm_spellings():
    config = config_from_args(_args("--request-rate", "2", "--max-concurrency", "4", "--dataset-name", "random",
                                    "--random-input-len", "12", "--random-output-len", "5", "--endpoint",
                                    "/v1/chat/completions", "--goodput", "e2el:900"))
    assert config.url == "http://127.0.0.1:8000" and config.rates == (2.0,) and config.concurrency == 4
    assert config.dataset.input_len == 12 and config.dataset.output_len == 5 and config.endpoint == "chat"
    assert config.slo.e2e_ms == 900
    assert config_from_args(_args("--port", "9001")).url == "http://127.0.0.1:9001"
    with pytest.raises(BenchInputError, match="--percentile-metrics"):
        config_from_args(_args("--percentile-metrics", "ttft,latency"))
    with pytest.raises(BenchInputError, match="--backend openai-chat sends to chat"):
        config_from_args(_args("--backend", "openai-chat", "--endpoint", "completions"))
