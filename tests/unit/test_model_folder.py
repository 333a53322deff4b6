"""--model names a local checkpoint folder; a Hub id gets a hint that epd does not download."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.model_folder import model_folder_problem

pytestmark = [pytest.mark.unit]


def test_a_hub_id_with_no_such_folder_says_a_local_folder_is_needed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    problem = model_folder_problem(Path("Qwen/Qwen2-0.5B-Instruct"))
    assert problem is not None and "Hugging Face Hub id" in problem and "does not download" in problem
    assert "`hf download Qwen/Qwen2-0.5B-Instruct --local-dir ./Qwen2-0.5B-Instruct`" in problem  # hub's CLI
    # "./models/llama" reaches here as models/llama: the message must not claim it is a Hub id
    assert problem.startswith("Qwen/Qwen2-0.5B-Instruct: not a checkpoint folder (it does not exist)")


def test_a_folder_named_like_a_hub_id_is_served(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    (tmp_path / "org" / "model" / "config.json").write_text("{}")
    assert model_folder_problem(Path("org/model")) is None


def test_other_mistakes_name_the_path_and_what_is_wrong(tmp_path):
    assert "does not exist" in model_folder_problem(tmp_path / "nope")
    assert "no config.json" in model_folder_problem(tmp_path)
    (tmp_path / "f").write_text("x")
    assert "it is a file" in model_folder_problem(tmp_path / "f")


def test_epd_serve_with_a_hub_id_says_so_in_one_line_before_starting_anything(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env["EPD_STATE_DIR"] = str(tmp_path / "state")
    out = subprocess.run([sys.executable, "-m", "controlplane.cli", "serve", "--model", "Qwen/Qwen2-0.5B-Instruct"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("epd: error: model: Qwen/Qwen2-0.5B-Instruct: not a checkpoint folder")
    assert "Hugging Face Hub id" in out.stderr and "does not download" in out.stderr
    assert not (tmp_path / "state").exists()
