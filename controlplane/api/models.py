"""Request and response bodies in OpenAI's shapes.

Requests are strict (a string where a number belongs is a 400, not a silent coercion) and ignore
fields they do not know, as OpenAI's SDKs add new optional fields over time. Fields that are known
but not supported are refused in ``prompts.py`` rather than ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer
from pydantic_core import PydanticCustomError


def _unicode_text(value: str) -> str:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"); Python keeps it, and it cannot be encoded
    (tokenised, sent to a worker or echoed in an error). Refuse it here, naming where it is."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PydanticCustomError(
                "invalid_unicode", "the text holds a lone UTF-16 surrogate (\\u{code}) at character {at}, "
                "which is not a Unicode character", {"code": f"{ord(value[exc.start]):04x}", "at": exc.start}) from None
    return value


Text = Annotated[str, AfterValidator(_unicode_text)]  # every string a request carries


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ImageURL(_Request):
    url: Text
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
CONTENT_PART_TAGS = ("text", "image_url")  # pydantic puts the tag in an error's location, after the index


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[Any] | None = None  # refused when present: a prompt cannot show them
    function_call: Any = None  # the deprecated form of tool_calls


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: Text


class _GenerationFields(_Request):
    """What chat and text completions share."""

    model: Text
    max_tokens: int | None = None  # None: the rest of the context (chat), 16 (completions)
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: Text | None = None
    # vLLM/SGLang extensions. Served: ignore_eos (run to max_tokens past end-of-sequence, for benchmarks),
    # top_k (0 or -1: off) and stop_token_ids; the others are refused unless they ask for the default.
    ignore_eos: bool | None = None
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    use_beam_search: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    echo: bool | None = None  # OpenAI's on completions, vLLM's on chat: refused


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # wins over max_tokens, as in OpenAI's API
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None  # the deprecated form of tools
    function_call: Any = None
    response_format: ResponseFormat | None = None
    # vLLM's chat-template extensions: each changes the prompt, so each is refused unless it asks for the default
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_GenerationFields):
    """``max_tokens`` defaults to 16 here, as in OpenAI's API and vLLM (chat: the rest of the context)."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    best_of: int | None = None
    suffix: Text | None = None
    logprobs: int | None = None


# ---------------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None


class Delta(BaseModel):
    """Only the fields a chunk carries: {"role", "content": ""} first, then {"content"}, then {}."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _present_only(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.role is not None:
            out["role"] = self.role
        if self.content is not None:
            out["content"] = self.content
        return out


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """Both the whole answer and (object "text_completion" too, as OpenAI does) a stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "epd"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
