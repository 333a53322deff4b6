"""``python -m bench.train_checkpoint``: a short run writes a checkpoint folder that the
engine's own loader serves, and whose weights are not the demo's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


def train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.train_checkpoint", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_a_short_run_writes_a_checkpoint_the_engine_loads(tmp_path: Path, default_ckpt: Path) -> None:
    pytest.importorskip("transformers")
    from workers.runtime.generate import GenerateRequest, generate
    from workers.runtime.loader import load_model
    from workers.runtime.sampler import SamplingParams

    out = tmp_path / "trained"
    proc = train(str(out), "--minutes", "0.05", "--corpus-tokens", "50000", "--threads", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] >= 1 and info["tokens_seen"] == info["steps"] * 8 * 256
    trained, demo = load_model(out, with_vision=False), load_model(default_ckpt, with_vision=False)
    assert trained.config.num_layers == demo.config.num_layers and trained.config.vocab_size == demo.config.vocab_size
    w_t, w_d = dict(trained.model.named_parameters()), dict(demo.model.named_parameters())
    assert w_t.keys() == w_d.keys()
    assert not all(torch.equal(w_t[k], w_d[k]) for k in w_t)  # a fresh model, not the demo's weights
    req = GenerateRequest(prompt_ids=trained.tokenizer.encode("def main():"),
                          params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(generate(trained, [req])[0].token_ids) == 4


def test_a_non_empty_folder_and_bad_numbers_are_refused(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("keep me")
    proc = train(str(tmp_path), "--minutes", "0.05")
    assert proc.returncode == 2 and "is not empty" in proc.stderr
    assert (tmp_path / "x").read_text() == "keep me"
    proc = train(str(tmp_path / "new"), "--minutes", "0")
    assert proc.returncode == 2 and "--minutes must be positive" in proc.stderr
    assert not (tmp_path / "new").exists()
