"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP.

  /tokenize    {"prompt": str, "add_special_tokens": true}            the ids a completion prompt becomes
               {"messages": [...], "add_generation_prompt": true}      the ids a chat request becomes (chat
                                                                       template applied, each image expanded to
                                                                       its tokens), exactly as /v1 would send
               -> {"count", "max_model_len", "tokens", "token_strs"}  (token_strs only if return_token_strs)
  /detokenize  {"tokens": [int]} -> {"prompt": str}                   special tokens kept, as vLLM does

``model`` is optional; when given it must be the served model's id (404 otherwise). Like vLLM's, these sit
beside /v1 and run no model; the API keys that guard /v1 guard them too.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Discriminator, Field, Tag, model_validator
from starlette.responses import Response

from controlplane.api.errors import CHAT_BODY, PROMPT_BODY, APIError
from controlplane.api.limits import OffLoopJSONRoute, prepare_off_loop
from controlplane.api.models import ChatMessage, Text, _Request
from controlplane.api.prompts import chat_ids, check_model, tokenise
from controlplane.backend import ModelInfo


class TokenizeCompletion(_Request):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Request):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and "prompt" in data:
            raise ValueError("give a prompt or messages, not both")
        return data


def _kind(body: Any) -> str:
    """A body with ``messages`` is a chat's; any other, a prompt's (so its errors name the prompt's fields)."""
    return CHAT_BODY if isinstance(body, dict) and "messages" in body else PROMPT_BODY


TokenizeBody = Annotated[Annotated[TokenizeChat, Tag(CHAT_BODY)] | Annotated[TokenizeCompletion, Tag(PROMPT_BODY)],
                         Discriminator(_kind)]


class Detokenize(_Request):
    model: Text | None = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_router(model: ModelInfo) -> APIRouter:
    router = APIRouter(route_class=OffLoopJSONRoute)  # a large body's JSON parsed off the loop

    @router.post("/tokenize")
    async def tokenize(body: TokenizeBody, request: Request) -> Response:
        if body.model is not None:
            check_model(body.model, model)
        if isinstance(body, TokenizeChat):
            chat = body
            ids = await prepare_off_loop(request, lambda: chat_ids(chat, model, chat.add_generation_prompt))
        else:
            text, add = body.prompt, body.add_special_tokens
            ids = await prepare_off_loop(request, lambda: tokenise(lambda: model.tokenizer.encode(
                text, add_special_tokens=add)))
        def answer() -> str:
            strs = [model.tokenizer.backend.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
            return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids,
                                    token_strs=strs).model_dump_json()
        return Response(await prepare_off_loop(request, answer), media_type="application/json")

    @router.post("/detokenize")
    async def detokenize(body: Detokenize, request: Request) -> Response:
        if body.model is not None:
            check_model(body.model, model)

        def answer() -> str:
            vocab = model.tokenizer.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
            text = model.tokenizer.decode(body.tokens, skip_special_tokens=False)
            return DetokenizeResponse(prompt=text).model_dump_json()
        return Response(await prepare_off_loop(request, answer), media_type="application/json")

    return router
