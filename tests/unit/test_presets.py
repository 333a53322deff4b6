"""`epd model init --preset`: the 1b shape's numbers, and a small preset written, loaded and run."""

from __future__ import annotations

import json

import pytest

from controlplane.cli import main
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.loader import load_model
from workers.runtime.presets import PRESETS
from workers.runtime.sampler import SamplingParams

pytestmark = pytest.mark.unit


def test_1b_preset_is_tinyllamas_shape() -> None:
    p = PRESETS["1b"]
    assert (p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads, p.intermediate_size, p.vocab_size) == (
        2048, 22, 32, 4, 5632, 32000)
    assert 1.09e9 < p.num_parameters < 1.11e9  # TinyLlama-1.1B has 1,100,048,384


def test_model_init_preset_writes_a_loadable_folder(tmp_path, capsys) -> None:
    folder = tmp_path / "tiny"
    assert main(["model", "init", "--preset", "tiny", str(folder)]) == 0
    assert "preset tiny" in capsys.readouterr().out
    hf = json.loads((folder / "config.json").read_text())
    p = PRESETS["tiny"]
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_key_value_heads"], hf["vocab_size"]) == (
        p.hidden_size, p.num_layers, p.num_kv_heads, p.vocab_size)
    # every file as readable as config.json (safetensors alone writes its file 0600)
    modes = {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir() if f.is_file()}
    assert modes["model.safetensors"] == modes["config.json"], modes
    bundle = load_model(folder)
    assert sum(t.numel() for t in bundle.model.parameters()) == p.num_parameters
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(kv_cache_bytes=1 << 22), bundle.eos_token_ids)
    engine.add_request("r", bundle.tokenizer.encode("Hello"), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def test_model_init_refuses_an_unknown_preset(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["model", "init", "--preset", "70b", str(tmp_path / "x")])
    assert "invalid choice: '70b'" in capsys.readouterr().err
