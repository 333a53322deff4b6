"""The single-process reference: encode, prefill and decode chained in one process.

This is the oracle. The disaggregated path (three pools, KV over the wire) must produce exactly
the tokens ``generate`` produces for the same checkpoint, prompt and sampling parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import InvalidRequestError
from workers.runtime.loader import LoadedModel
from workers.runtime.multimodal import expand_image_tokens
from workers.runtime.sampler import SamplingParams, TokenLogprobs
from workers.runtime.sequence import FinishReason, MultimodalInput
from workers.runtime.tokenizer import Message
from workers.runtime.vision import encode_images, preprocess_images


@dataclass(frozen=True)
class GenerateRequest:
    """Exactly one of ``prompt`` (text), ``messages`` (chat) or ``prompt_ids``."""

    prompt: str | None = None
    messages: list[Message] | None = None
    prompt_ids: list[int] | None = None
    images: tuple[bytes, ...] = ()
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class GenerateResult:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when params.logprobs is set
    # one per prompt token after the first, when params.prompt_logprobs is set
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


def build_prompt(bundle: LoadedModel, req: GenerateRequest) -> tuple[list[int], MultimodalInput | None]:
    """Tokenise (rendering the chat template for messages), encode images, expand placeholders."""
    given = [x is not None for x in (req.prompt, req.messages, req.prompt_ids)]
    if sum(given) != 1:
        raise InvalidRequestError("give exactly one of prompt, messages or prompt_ids")
    if req.images and (bundle.vision is None or bundle.image_token_id is None):
        raise InvalidRequestError("this model does not accept images (it has no vision tower)")
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
    else:
        if bundle.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; pass prompt_ids")
        if req.messages is not None:
            ids = bundle.tokenizer.encode_chat(req.messages)
        elif req.prompt is not None:  # exactly one of the three is given (checked above)
            ids = bundle.tokenizer.encode(req.prompt)
    if not req.images:
        return ids, None
    assert bundle.vision is not None and bundle.image_token_id is not None
    cfg = bundle.vision.config
    pixels = list(preprocess_images(req.images, cfg).values())
    embeds = encode_images(bundle.vision, pixels)
    ids, positions = expand_image_tokens(ids, bundle.image_token_id, cfg.num_image_tokens, len(req.images))
    return ids, MultimodalInput(torch.cat(embeds).to(torch.float32), positions)


def generate(bundle: LoadedModel, requests: list[GenerateRequest],
             config: EngineConfig = EngineConfig()) -> list[GenerateResult]:
    """Run ``requests`` to completion in a fresh engine; results in request order."""
    engine = Engine(bundle.model, bundle.tokenizer, config, bundle.eos_token_ids)
    prompts: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
        ids, mm = build_prompt(bundle, req)
        engine.add_request(str(i), ids, req.params, mm)
        prompts[str(i)] = ids
    tokens: dict[str, list[int]] = {k: [] for k in prompts}
    texts: dict[str, list[str]] = {k: [] for k in prompts}
    reasons: dict[str, FinishReason] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {k: [] for k in prompts}
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {k: [] for k in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            texts[out.request_id].append(out.text)
            if out.logprobs is not None:
                logprobs[out.request_id].append(out.logprobs)
            if out.prompt_logprobs is not None:
                prompt_logprobs[out.request_id] = list(out.prompt_logprobs)
            if out.finished:
                assert out.finish_reason is not None
                reasons[out.request_id] = out.finish_reason
    return [GenerateResult(prompts[k], tokens[k], "".join(texts[k]), reasons[k], logprobs[k], prompt_logprobs[k])
            for k in prompts]
