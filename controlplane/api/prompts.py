"""A validated request body becomes a ``WorkerRequest``: prompt ids, images and sampling params.

Chat: the messages are rendered with the model's chat template (an ``image_url`` part becomes
``{"type": "image"}``), tokenised with ``encode_chat``, and each image placeholder is repeated
``tokens_per_image`` times; the image bytes and placeholder positions travel with the request.
Completions: a string is tokenised with ``encode`` (special tokens added); token ids pass as is;
``max_tokens`` defaults to 16 (chat: the rest of the context).
Every client fault raises ``APIError`` (400, or 404 for an unknown model) before any worker sees it.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from controlplane.api.errors import APIError
from controlplane.api.limits import MAX_IMAGE_BYTES, MAX_IMAGES_BYTES, MiB
from controlplane.api.models import ChatCompletionRequest, ChatMessage, CompletionRequest, ImagePart, TextPart
from controlplane.backend import ModelInfo
from controlplane.dispatch import WorkerRequest
from workers.runtime.errors import ImageTooLargeError, InvalidImageError, InvalidRequestError
from workers.runtime.images import check_image_header
from workers.runtime.multimodal import expand_image_tokens
from workers.runtime.sampler import MAX_LOGPROBS, SamplingParams

COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's API and vLLM default it
SEED_SPAN = 2**63  # a request's seed is in [-2^63, 2^63), as vLLM's

_WHITESPACE = re.compile(r"\s+")


def check_model(requested: str, model: ModelInfo) -> None:
    if requested != model.name:
        raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")


# ----------------------------------------------------------------------------------- chat
def prepare_chat(body: ChatCompletionRequest, model: ModelInfo) -> WorkerRequest:
    check_model(body.model, model)
    _refuse_unsupported(body)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
        _check_logprobs(body.top_logprobs, "top_logprobs")
    # Tools under tool_choice "none" are accepted and left out of the prompt, as vLLM does by default: an agent
    # framework sends its tool list with every request, also when it asks for plain text.
    if body.tools and body.tool_choice != "none":
        raise APIError(400, "tools are not supported by this server (only with tool_choice \"none\", which leaves "
                            "them out).", param="tools")
    if body.functions and body.function_call != "none":
        raise APIError(400, "functions (tools) are not supported by this server (only with function_call "
                            "\"none\").", param="functions")
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none"):
            raise APIError(400, f"{name} needs tools, which this server does not support (only \"none\").",
                           param=name)
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "response_format must be {\"type\": \"text\"}; structured output is not supported.",
                       param="response_format")
    if body.add_generation_prompt is False or body.continue_final_message:
        name = "continue_final_message" if body.continue_final_message else "add_generation_prompt"
        raise APIError(400, f"{name}: continuing the last message is not supported; the answer is always a new "
                            f"assistant turn.", param=name)
    if body.chat_template is not None or body.chat_template_kwargs:
        name = "chat_template" if body.chat_template is not None else "chat_template_kwargs"
        raise APIError(400, f"{name} is not supported: the model's own chat template is used as it is.", param=name)
    messages, images = _template_messages(body, model)
    ids = tokenise(lambda: model.tokenizer.encode_chat(messages))
    ids, positions = _expand_images(ids, model, len(images), "messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = _sampling(body, max_tokens, param, len(ids), model, "messages",
                       (body.top_logprobs or 0) if body.logprobs else None)
    return WorkerRequest(str(uuid.uuid4()), ids, params, tuple(images), positions)


class HasMessages(Protocol):
    """A request that carries chat messages (a chat completion, a /tokenize of a chat)."""

    @property
    def messages(self) -> list[ChatMessage]: ...


def chat_ids(body: HasMessages, model: ModelInfo, add_generation_prompt: bool = True) -> list[int]:
    """The prompt ids the chat request ``body``'s messages become: template, tokens, each image's
    placeholder repeated to its token count (what ``prepare_chat`` sends, for /tokenize)."""
    messages, images = _template_messages(body, model)
    ids = tokenise(lambda: model.tokenizer.encode_chat(messages, add_generation_prompt))
    return _expand_images(ids, model, len(images), "messages")[0]


def _template_messages(body: HasMessages, model: ModelInfo) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The messages as the chat template sees them, and the decoded images in prompt order."""
    messages: list[dict[str, Any]] = []
    images: list[bytes] = []
    for i, msg in enumerate(body.messages):
        if msg.tool_calls or msg.function_call is not None:  # dropped, the prompt would misstate the history
            name = "tool_calls" if msg.tool_calls else "function_call"
            raise APIError(400, f"messages[{i}].{name}: a conversation with tool calls is not supported by this "
                                f"server (it cannot render them into the prompt).", param=f"messages[{i}].{name}")
        if msg.content is None:
            if msg.role != "assistant":
                raise APIError(400, f"messages[{i}].content is required for role '{msg.role}'.",
                               param=f"messages[{i}].content")
            content: str | list[dict[str, str]] = ""
        elif isinstance(msg.content, str):
            content = msg.content
        else:
            content = []
            for j, part in enumerate(msg.content):
                if isinstance(part, TextPart):
                    content.append({"type": "text", "text": part.text})
                else:
                    assert isinstance(part, ImagePart)
                    where = f"messages[{i}].content[{j}].image_url"
                    if model.image_token_id is None:
                        raise APIError(400, f"The model `{model.name}` does not accept images.", param=where)
                    images.append(decode_data_url(part.image_url.url, where))
                    try:  # its header, here where the field can be named (the encoder decodes the pixels)
                        check_image_header(images[-1])
                    except InvalidImageError as exc:
                        code = "image_too_large" if isinstance(exc, ImageTooLargeError) else "invalid_image"
                        raise APIError(400, f"{exc}.", param=where, code=code) from None
                    content.append({"type": "image"})
                    if sum(map(len, images)) > MAX_IMAGES_BYTES:
                        raise APIError(400, f"the request's images come to more than {MAX_IMAGES_BYTES // MiB} MiB "
                                            "together; send fewer or smaller images.", param=where,
                                       code="image_too_large")
        # OpenAI's developer messages are its system messages renamed; a chat template knows only "system"
        message: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": content}
        if msg.name is not None:  # templates that print a speaker's name read it (as vLLM passes it)
            message["name"] = msg.name
        messages.append(message)
    return messages, images


def decode_data_url(url: str, param: str) -> bytes:
    """The bytes of a base64 ``data:`` URL; anything else (http(s) included) is a 400."""
    scheme, colon, rest = url.strip().partition(":")
    if scheme.lower() in ("http", "https"):
        raise APIError(400, "remote image URLs are not supported; send a data: URL "
                            "(data:image/png;base64,...).", param=param, code="invalid_image_url")
    header, comma, payload = rest.partition(",")
    if scheme.lower() != "data" or not colon or not comma:
        raise APIError(400, "image_url.url must be a data: URL (data:image/png;base64,...).", param=param,
                       code="invalid_image_url")
    if header.split(";")[-1].strip().lower() != "base64":
        raise APIError(400, "the image data: URL must be base64-encoded (data:image/png;base64,...).",
                       param=param, code="invalid_image_url")
    if len(payload) // 4 * 3 > MAX_IMAGE_BYTES + 3:  # base64's size, before decoding anything
        raise APIError(400, f"the image is {len(payload) // 4 * 3 / MiB:.1f} MiB; images may be at most "
                            f"{MAX_IMAGE_BYTES // MiB} MiB each.", param=param, code="image_too_large")
    try:
        data = base64.b64decode(_WHITESPACE.sub("", payload), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "the image data: URL is not valid base64.", param=param,
                       code="invalid_image_url") from None
    if not data:
        raise APIError(400, "the image data: URL holds no data.", param=param, code="invalid_image_url")
    if len(data) > MAX_IMAGE_BYTES:
        raise APIError(400, f"the image is {len(data) / MiB:.1f} MiB; images may be at most "
                            f"{MAX_IMAGE_BYTES // MiB} MiB each.", param=param, code="image_too_large")
    return data


# ----------------------------------------------------------------------------------- completions
def prepare_completion(body: CompletionRequest, model: ModelInfo) -> WorkerRequest:
    check_model(body.model, model)
    _refuse_unsupported(body)
    if body.best_of not in (None, 1):
        raise APIError(400, "best_of must be 1.", param="best_of")
    if body.suffix:
        raise APIError(400, "suffix is not supported by this server.", param="suffix")
    if body.logprobs is not None:  # 0 asks for the chosen token's own logprob
        _check_logprobs(body.logprobs, "logprobs")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "batched prompts are not supported; send one prompt per request.", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = prompt
        ids = tokenise(lambda: model.tokenizer.encode(text))
    else:
        ids = list(prompt)  # type: ignore[arg-type]  # a batch of one was unwrapped above; its element type is not narrowed
        vocab = model.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab}).", param="prompt")
    if not ids:
        raise APIError(400, "The prompt is empty.", param="prompt")
    _expand_images(ids, model, 0, "prompt")  # a literal image placeholder without an image is refused
    max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    params = _sampling(body, max_tokens, "max_tokens", len(ids), model, "prompt", body.logprobs,
                       body.logprobs if body.echo else None)  # echo with logprobs: the prompt's too
    return WorkerRequest(str(uuid.uuid4()), ids, params)


def echo_text(body: CompletionRequest, request: WorkerRequest, model: ModelInfo) -> str:
    """The prompt as ``echo`` sends it back: the text given, or a token-id prompt decoded."""
    prompt = body.prompt[0] if isinstance(body.prompt, list) and body.prompt and isinstance(
        body.prompt[0], (str, list)) else body.prompt
    if isinstance(prompt, str):
        return prompt
    return model.tokenizer.decode(list(request.prompt_ids))


# ----------------------------------------------------------------------------------- shared
def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Fields chat and text completions share that this server does not serve (OpenAI's, and vLLM's
    sampling extensions): refused unless they ask for the default."""
    if body.n not in (None, 1):
        raise APIError(400, "n must be 1: this server returns one choice per request.", param="n")
    for name, value in (("presence_penalty", body.presence_penalty), ("frequency_penalty", body.frequency_penalty)):
        if value not in (None, 0.0):
            raise APIError(400, f"{name} is not supported by this server (only 0).", param=name)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported by this server.", param="logit_bias")
    if body.echo and isinstance(body, ChatCompletionRequest):  # vLLM's chat echo (the last message)
        raise APIError(400, "echo is not supported on chat completions by this server.", param="echo")
    for name, default in (("min_p", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0)):
        value = getattr(body, name)
        if value is not None and value != default:
            raise APIError(400, f"{name} is not supported by this server (only {default:g}).", param=name)
    if body.use_beam_search:
        raise APIError(400, "beam search is not supported by this server.", param="use_beam_search")
    if body.include_stop_str_in_output:
        raise APIError(400, "include_stop_str_in_output is not supported: a stop string is left out of the text.",
                       param="include_stop_str_in_output")
    if body.skip_special_tokens is False:
        raise APIError(400, "special tokens are always left out of the text; skip_special_tokens must be true.",
                       param="skip_special_tokens")


def tokenise(run: Callable[[], list[int]]) -> list[int]:
    try:
        return list(run())
    except InvalidRequestError as exc:  # the chat template refused the messages
        raise APIError(400, str(exc), param="messages") from None


def _expand_images(ids: list[int], model: ModelInfo, num_images: int,
                   param: str) -> tuple[list[int], tuple[int, ...]]:
    if model.image_token_id is None:
        return ids, ()
    try:
        return expand_image_tokens(ids, model.image_token_id, model.tokens_per_image, num_images)
    except InvalidRequestError as exc:  # e.g. the image token typed into the text
        raise APIError(400, f"{exc}; the text must not contain the image placeholder token.",
                       param=param) from None


def _check_logprobs(n: int, param: str) -> None:
    if not 0 <= n <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must be an integer in [0, {MAX_LOGPROBS}], got {n}.", param=param)


def _sampling(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, max_param: str,
              prompt_len: int, model: ModelInfo, noun: str, logprobs: int | None = None,
              prompt_logprobs: int | None = None) -> SamplingParams:
    """``noun``: "messages" or "prompt", for the context-length message and its param. ``logprobs``: how many
    top tokens' logprobs each output token comes with (0: its own alone; None: none); ``prompt_logprobs``: the
    same for each prompt token."""
    vocab = model.tokenizer.vocab_size
    if body.stop_token_ids and any(not 0 <= t < vocab for t in body.stop_token_ids):
        raise APIError(400, f"stop_token_ids must be in [0, {vocab}).", param="stop_token_ids")
    limit = model.max_model_len
    to_context = max_tokens is None
    if max_tokens is None:
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your {noun} "
                                f"resulted in {prompt_len} tokens. Please reduce the length of the {noun}.",
                           param=noun, code="context_length_exceeded")
        max_tokens = limit - prompt_len
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                       param="stream_options")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    seed = body.seed
    if seed is not None:  # vLLM's range; the engine's seeds are [0, 2^63), where a negative one draws as seed + 2^63
        if not -SEED_SPAN <= seed < SEED_SPAN:
            raise APIError(400, f"seed must be an integer in [-2^63, 2^63), got {seed}", param="seed")
        seed %= SEED_SPAN
    try:
        params = SamplingParams(max_tokens=max_tokens,
                                temperature=1.0 if body.temperature is None else body.temperature,
                                top_p=1.0 if body.top_p is None else body.top_p,
                                top_k=0 if body.top_k in (None, -1) else body.top_k,  # vLLM spells off -1
                                seed=seed, stop=stop, stop_token_ids=tuple(body.stop_token_ids or ()),
                                ignore_eos=bool(body.ignore_eos), to_context=to_context, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs)
    except InvalidRequestError as exc:
        param = _param_of(str(exc), max_param)
        message = str(exc)
        if param == max_param and max_param != "max_tokens":  # name the field the client sent
            message = max_param + message[len("max_tokens"):]
        raise APIError(400, message, param=param) from None
    if prompt_len + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {noun}, {max_tokens} in the "
                            f"completion). Please reduce the length of the {noun} or completion.",
                       param=noun, code="context_length_exceeded")
    return params


def _param_of(message: str, max_param: str) -> str | None:
    """SamplingParams names the field first in its message."""
    name = message.split(" ", 1)[0]
    if name == "max_tokens":
        return max_param
    return name if name in ("temperature", "top_p", "top_k", "seed", "stop") else None
