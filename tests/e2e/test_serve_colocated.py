"""`epd serve --mode colocated`: the aggregated baseline as a first-class deployment.

One pool of decode-pool workers that each encode, prefill and decode whole requests. Answers through
the official openai client equal the single-process reference for text and images; the decode
pool scales; the prefill and encode pools cannot be scaled in this mode and say why.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import pytest
from PIL import Image

from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.sampler import SamplingParams

from serve_process import chat_concurrently, serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_ckpt):
    settings = {"model": str(default_ckpt), "mode": "colocated",
                "decode": {"replicas": 1, "num_cpus": 0.25, "engine": {"kv_cache_bytes": 64 * 2**20}}}
    with serve_process(settings, tmp_path_factory.mktemp("serve-colocated")) as served:
        yield served


def _png(color: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_text_and_image_requests_match_the_reference(served, default_bundle):
    from openai import OpenAI

    client = OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    prompts = [f"Colocated question {i}: what is in the cache?" for i in range(8)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    refs = generate(default_bundle, [GenerateRequest(messages=[{"role": "user", "content": p}], params=greedy)
                                     for p in prompts])

    got = chat_concurrently(client, model, prompts, max_tokens=12, join_s=120)
    assert got == [r.text for r in refs]

    url = _png((10, 200, 40))
    raw = base64.b64decode(url.split(",", 1)[1])
    ref = generate(default_bundle, [GenerateRequest(
        messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
        images=(raw,), params=greedy)])[0]
    content: list[Any] = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What colour?"}]
    out = client.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                         messages=[{"role": "user", "content": content}])
    assert out.choices[0].message.content == ref.text

    # one engine ran each request whole: the response says how long it took (Server-Timing)
    from controlplane.observability.server_timing import engine_seconds

    resp = httpx.post(f"{served.base}/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": prompts[0]}]})
    assert resp.status_code == 200 and 0 < engine_seconds(resp.headers["server-timing"]) < 60


def test_only_the_decode_pool_runs_and_scales(served):
    pools = {p["pool"]: p for p in served.status()["pools"]}
    assert {name: p["ready"] for name, p in pools.items()} == {"encode": 0, "prefill": 0, "decode": 1}
    refused = served.cli("scale", "prefill", "2")
    assert refused.returncode != 0 and "colocated mode has no prefill pool" in refused.stderr
    assert served.cli("scale", "decode", "2").returncode == 0
    pools = {p["pool"]: p for p in served.status()["pools"]}
    assert pools["decode"]["target"] == 2 and pools["prefill"]["ready"] == 0


def test_logprobs_through_the_scheduler_and_a_colocated_worker_match_the_reference(served, default_bundle):
    """The real path (API, scheduler, Complete on a worker in its own process): each token of a sampled answer
    with its log-probability and the top two, as the single-process reference computes them (within float32
    rounding, 1e-4 as against HF: the worker's process may run another number of threads)."""
    prompt = "Colocated logprobs: name a colour."
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=5, logprobs=2)
    ref = generate(default_bundle, [GenerateRequest(prompt=prompt, params=params)])[0]
    model = httpx.get(f"{served.base}/v1/models", timeout=10).json()["data"][0]["id"]
    resp = httpx.post(f"{served.base}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.9, "seed": 5, "logprobs": 2})
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    tok = default_bundle.tokenizer
    assert lp["tokens"] == [tok.decode([i], skip_special_tokens=False) for i in ref.token_ids]
    assert lp["token_logprobs"] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
    for top, want in zip(lp["top_logprobs"], ref.logprobs):
        assert len(top) in (2, 3)  # the top two, and the chosen token when it is not one of them
        for i, v in want.top:
            assert top[tok.decode([i], skip_special_tokens=False)] == pytest.approx(v, abs=1e-4)
    # echo with logprobs: the prompt's too, from the worker's own prefill
    scored = httpx.post(f"{served.base}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}).json()
    scored_ref = generate(default_bundle, [GenerateRequest(prompt=prompt, params=SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=1))])[0].prompt_logprobs
    figures = scored["choices"][0]["logprobs"]["token_logprobs"]
    assert figures[0] is None and figures[1:len(scored_ref) + 1] == pytest.approx([t.logprob for t in scored_ref],
                                                                            abs=1e-4)
