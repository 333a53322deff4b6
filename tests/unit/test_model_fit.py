"""What a deployment derives from its model and engines before anything starts: the pools a model needs
(a text-only model has no encode pool, and asking for one is refused) and the default wire codec, which is
exact for the cache's dtype (quantised wires only when asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch

from controlplane.serve import fit_pools, model_info, validate
from controlplane.settings import LOSSLESS, Settings, SettingsError
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.loader import load_model
from workers.runtime.sampler import SamplingParams

from engine_helpers import run_to_completion
from hf_checkpoints import write_llava, write_text_model

pytestmark = [pytest.mark.unit]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fit")
    return {"llama": write_text_model(root / "llama"), "qwen2": write_text_model(root / "qwen2", arch="qwen2"),
            "llava": write_llava(root / "llava")}


# ------------------------------------------------------------------ the pools follow the model
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_text_only_model_runs_no_encode_pool_and_says_why(folders, no_epd_env, kind):
    settings = Settings.load(None, {"model": str(folders[kind])})
    info = model_info(settings, folders[kind])
    fitted, not_needed = fit_pools(settings, info, folders[kind])
    assert info.image_token_id is None
    assert fitted.encode.replicas == 0 and (fitted.prefill.replicas, fitted.decode.replicas) == (1, 1)
    assert set(not_needed) == {"encode"} and "text-only" in not_needed["encode"]


@pytest.mark.parametrize("source", ["yaml", "env", "override"])
def test_asking_for_encode_replicas_for_a_text_only_model_is_refused(folders, no_epd_env, tmp_path, monkeypatch,
                                                                      source):
    folder = folders["llama"]
    config = None
    if source == "yaml":
        config = tmp_path / "epd.yaml"
        config.write_text("encode:\n  replicas: 2\n")
    elif source == "env":
        monkeypatch.setenv("EPD_ENCODE__REPLICAS", "2")
    settings = Settings.load(config, {"model": str(folder), **({"encode": {"replicas": 2}}
                                                               if source == "override" else {})})
    with pytest.raises(SettingsError, match=r"encode.replicas=2: the model .* is text-only \(it has no vision "
                                            r"tower\), so it needs no encode pool"):
        fit_pools(settings, model_info(settings, folder), folder)


def test_an_explicit_zero_is_fine_and_a_multimodal_model_keeps_its_encode_pool(folders, no_epd_env):
    text = Settings.load(None, {"model": str(folders["llama"]), "encode": {"replicas": 0}})
    assert fit_pools(text, model_info(text, folders["llama"]), folders["llama"])[0].encode.replicas == 0
    mm = Settings.load(None, {"model": str(folders["llava"]), "encode": {"replicas": 2}})
    fitted, not_needed = fit_pools(mm, model_info(mm, folders["llava"]), folders["llava"])
    assert fitted.encode.replicas == 2 and not_needed == {}


def test_a_vision_model_without_an_encode_pool_is_refused(folders, no_epd_env):
    """Before: it started, and /ready waited for an encode replica that would never come."""
    mm = Settings.load(None, {"model": str(folders["llava"]), "encode": {"replicas": 0}})
    with pytest.raises(SettingsError, match=r"encode.replicas=0: the model llava has a vision tower, so image "
                                            r"requests need the encode pool"):
        fit_pools(mm, model_info(mm, folders["llava"]), folders["llava"])
    colocated = Settings.load(None, {"model": str(folders["llava"]), "mode": "colocated"})  # its engine encodes
    assert fit_pools(colocated, model_info(colocated, folders["llava"]), folders["llava"])[0].mode == "colocated"


def test_a_vision_models_encode_pool_needs_the_prefill_pools_dtype(folders, no_epd_env):
    """The prefill worker checks the encoder's fingerprint, which covers the vision tower's weights as loaded."""
    bf16 = {"engine": {"dtype": "bfloat16"}}
    mm = Settings.load(None, {"model": str(folders["llava"]), "prefill": bf16, "decode": bf16})
    with pytest.raises(SettingsError, match=r"encode.engine.dtype \(float32\) and prefill.engine.dtype \(bfloat16\) "
                                            r"must match for a vision model"):
        fit_pools(mm, model_info(mm, folders["llava"]), folders["llava"])
    mm = Settings.load(None, {"model": str(folders["llava"]), "encode": bf16, "prefill": bf16, "decode": bf16})
    assert fit_pools(mm, model_info(mm, folders["llava"]), folders["llava"])[1] == {}
    text = Settings.load(None, {"model": str(folders["llama"]), "prefill": bf16, "decode": bf16})  # no encode pool
    assert fit_pools(text, model_info(text, folders["llama"]), folders["llama"])[0].encode.replicas == 0


def test_colocated_mode_still_names_its_missing_pools(folders, no_epd_env):
    s = Settings.load(None, {"model": str(folders["llava"]), "mode": "colocated"})
    assert set(fit_pools(s, model_info(s, folders["llava"]), folders["llava"])[1]) == {"encode", "prefill"}


# ------------------------------------------------------------------ exact by default
@pytest.mark.parametrize("engines, expected", [
    ({}, "fp32"),  # the default float32 engines: float32 cache, fp32 wire
    ({"dtype": "bfloat16"}, "bf16"),
    ({"kv_cache_dtype": "bfloat16"}, "bf16"),  # a bf16 cache under a float32 engine
    ({"kv_cache_dtype": "float16"}, "fp32"),  # bf16 would round float16's mantissa
    ({"kv_cache_dtype": "int8"}, "fp32"),  # an int8 cache is read back as float32
    ({"dtype": "bfloat16", "kv_cache_dtype": "fp8"}, "bf16"),
])
def test_the_default_wire_codec_is_lossless_for_the_cache(no_epd_env, engines, expected):
    s = Settings.load(None, {"prefill": {"engine": engines}, "decode": {"engine": engines}})
    assert s.transfer.codec_policy == LOSSLESS and s.wire_codec_policy() == expected


def test_a_bfloat16_decode_cache_gets_bf16_even_from_a_float32_prefill_cache(no_epd_env):
    """The decode cache rounds to bf16 on arrival either way; fp32 would cost twice the bytes for nothing.
    (The engines' own dtypes must match: tests/unit/test_settings.py.)"""
    s = Settings.load(None, {"decode": {"engine": {"kv_cache_dtype": "bfloat16"}}})
    assert s.wire_codec_policy() == "bf16"


@pytest.mark.parametrize("policy", ["int8", "fp8", "int4", "int8,0=bf16,-1=bf16", "auto", "auto:0.05", "bf16"])
def test_quantised_wires_are_opt_in_and_kept_as_written(no_epd_env, monkeypatch, policy):
    monkeypatch.setenv("EPD_TRANSFER__CODEC_POLICY", policy)
    assert Settings.load().wire_codec_policy() == policy


def test_lossless_is_spelled_like_any_policy_and_checked_against_the_model(folders, no_epd_env, monkeypatch):
    monkeypatch.setenv("EPD_TRANSFER__CODEC_POLICY", " lossless ")
    s = Settings.load(None, {"model": str(folders["llama"])})
    assert s.transfer.codec_policy == LOSSLESS
    validate(s, folders["llama"])
    with pytest.raises(SettingsError, match="unknown codec 'lossy'"):
        Settings.load(None, {"transfer": {"codec_policy": "lossy"}})


# ------------------------------------------------------------------ text-only HF folders run as transformers
@pytest.mark.transformers
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_text_only_folder_chats_as_transformers_does(folders, kind):
    """The chat template, token ids, logits (1e-4) and 16 greedy tokens of transformers' own model."""
    import transformers

    folder = folders[kind]
    bundle = load_model(folder)
    messages = [{"role": "user", "content": "Please write a short poem about the sea."}]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    want = cast(Any, tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True))["input_ids"]
    ids = bundle.tokenizer.encode_chat(messages)
    assert ids == list(want)
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(kv_cache_bytes=1 << 22))
    engine.add_request("r", ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, return_logits=True))
    outs = run_to_completion(engine)["r"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True,
                          pad_token_id=0)
    assert [o.new_token_ids[0] for o in outs] == ref.sequences[0, len(ids):].tolist()
    assert max((o.logits - ref_logits[0]).abs().max().item() for o, ref_logits in zip(outs, ref.logits)) <= 1e-4


def test_a_template_written_for_string_content_takes_openai_text_parts(folders):
    """As vLLM does: text-only parts are joined into the string such a template expects; an image part for a
    text-only template is a clear InvalidRequestError, not a TypeError from inside jinja."""
    from workers.runtime.errors import InvalidRequestError

    tok = load_model(folders["llama"]).tokenizer
    as_string = tok.render_chat([{"role": "user", "content": "one\ntwo"}])
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert tok.render_chat([{"role": "user", "content": parts}]) == as_string
    with pytest.raises(InvalidRequestError, match="chat template rejected the messages: TypeError"):
        tok.render_chat([{"role": "user", "content": [{"type": "image"}, *parts]}])
