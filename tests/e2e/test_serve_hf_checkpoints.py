"""An operator's first day: checkpoints made by transformers serve through `epd serve --model DIR` with no
other setting, and their greedy answers through the openai client equal transformers' own.

  - a text-only Llama folder: two pools (its encode pool is "not needed" and starts nothing), the default
    wire codec (lossless), chat and completions answers equal ``model.generate``'s;
  - a LLaVA folder (CLIP tower + Llama): three pools, an image and text in one chat request, the answer
    equal to ``LlavaForConditionalGeneration.generate`` over its own processor's inputs;
  - asking for encode replicas for a text-only model ends `epd serve` at once, in one line saying why.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from PIL import Image

from hf_checkpoints import write_llava, write_text_model
from serve_process import serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.transformers]

MAX_TOKENS = 16
QUESTIONS = ("What does the cache hold?", "Please write a short poem about the sea.")


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llava(tmp_path_factory.mktemp("hf") / "tiny-llava")


def _client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _hf_answer(model, ids: torch.Tensor, decode, **extra) -> tuple[str, str]:
    """transformers' greedy answer (text, finish reason) for prompt ``ids`` [1, n]."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0, **extra)[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    stopped = bool(out) and out[-1] in eos
    return decode(out, skip_special_tokens=True), "stop" if stopped else "length"


def test_a_text_only_llama_checkpoint_serves_as_it_is(tmp_path, text_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(text_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32).eval()
    with serve_process({}, tmp_path, args=("--model", str(text_dir))) as served:
        client = _client(served.base)
        model = client.models.list().data[0].id
        for q in QUESTIONS:
            messages = [{"role": "user", "content": q}]
            ids = cast(Any, tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True))["input_ids"]
            want = _hf_answer(hf, ids, tok.decode)
            got = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0).choices[0]
            assert (got.message.content, got.finish_reason) == want, q
            want = _hf_answer(hf, tok(q, return_tensors="pt")["input_ids"], tok.decode)
            got = client.completions.create(model=model, prompt=q, max_tokens=MAX_TOKENS, temperature=0).choices[0]
            assert (got.text, got.finish_reason) == want, q
        pools = {p["pool"]: p for p in served.status()["pools"]}
        assert pools["encode"]["target"] == 0 and pools["encode"]["ready"] == 0 and not pools["encode"]["workers"]
        assert "text-only" in pools["encode"]["not_needed"]
        assert pools["prefill"]["ready"] == 1 and pools["decode"]["ready"] == 1
        shown = served.cli("status")
        assert shown.returncode == 0 and "not needed" in shown.stdout, shown.stdout
        refused = served.cli("scale", "encode", "1")
        assert refused.returncode != 0 and "text-only" in refused.stderr, refused.stderr
        assert {p["pool"]: p["target"] for p in served.status()["pools"]}["encode"] == 0


def test_a_llava_checkpoint_serves_an_image_and_text_as_transformers_answers(tmp_path, llava_dir):
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(llava_dir)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    buf = io.BytesIO()
    rng = np.random.default_rng(7)
    Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with serve_process({}, tmp_path, args=("--model", str(llava_dir))) as served:
        client = _client(served.base)
        model = client.models.list().data[0].id
        for q in QUESTIONS:
            parts = [{"type": "image"}, {"type": "text", "text": q}]
            prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
            inputs = processor(images=[Image.open(io.BytesIO(buf.getvalue()))], text=prompt, return_tensors="pt")
            want = _hf_answer(hf, inputs["input_ids"], processor.tokenizer.decode,
                              pixel_values=inputs["pixel_values"])
            got = client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": q}]}]).choices[0]
            assert (got.message.content, got.finish_reason) == want, q
        pools = {p["pool"]: p for p in served.status()["pools"]}
        assert all(pools[p]["ready"] == 1 for p in ("encode", "prefill", "decode"))
        assert not pools["encode"].get("not_needed")


def test_encode_replicas_for_a_text_only_model_are_refused_at_start(tmp_path, text_dir):
    env = {**os.environ, "EPD_STATE_DIR": str(tmp_path / "state"), "EPD_ENCODE__REPLICAS": "2"}
    out = subprocess.run([sys.executable, "-m", "controlplane.cli", "serve", "--model", str(text_dir)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "encode.replicas=2" in lines[0] and "text-only" in lines[0], out.stderr
