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
    assert "huggingface-cli download Qwen/Qwen2-0.5B-Instruct --local-dir ./Qwen2-0.5B-Instruct" in problem


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
