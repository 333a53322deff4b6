"""Every error leaves the API in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

  ============================================  ======  ===========================
  cause                                         status  type / code
  ============================================  ======  ===========================
  unparsable JSON, a wrong type, a bad value    400     invalid_request_error
  prompt + max_tokens over the context          400     .. / context_length_exceeded
  unknown model                                 404     .. / model_not_found
  missing or wrong API key                      401     .. / invalid_api_key
  Overloaded (no decode room in bounds)         429     rate_limit_error, Retry-After
  StateError (Redis away: /admin, /dashboard)   503     server_error, Retry-After
  BackendError                                  its     its kind (4xx: invalid_request_error);
                                                        Retry-After when it has retry_after_s
  anything else (a bug; logged)                 500     server_error, generic message
  ============================================  ======  ===========================
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.models import CONTENT_PART_TAGS, ErrorBody, ErrorDetail
from controlplane.backend import BackendError, Overloaded
from controlplane.cancellation import ClientGone
from controlplane.state.errors import StateError
from workers.runtime.errors import InvalidRequestError

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "The server had an error while processing your request. Sorry about that!"


class APIError(Exception):
    """Raise anywhere in a request's handling to answer with this status and OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        # a message may echo what the client sent; keep it encodable whatever that held (a lone surrogate)
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def as_api_error(exc: BaseException) -> APIError:
    """The APIError for any exception; unexpected ones become a generic 500 (log them first)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Overloaded):
        retry = max(1, math.ceil(exc.retry_after_s)) if math.isfinite(exc.retry_after_s) else 1
        return APIError(429, str(exc) or "The server is overloaded; retry later.", type="rate_limit_error",
                        code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
    if isinstance(exc, BackendError):
        kind = exc.kind
        if exc.status < 500 and kind == "server_error":
            kind = "invalid_request_error"
        after = exc.retry_after_s
        headers = {"Retry-After": str(max(1, math.ceil(after)))} if after is not None and math.isfinite(after) else None
        return APIError(exc.status, str(exc), type=kind, headers=headers, code=exc.code)
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, ClientGone):  # nobody reads it: the client left
        return APIError(499, str(exc), type="client_closed_request")
    if isinstance(exc, StateError):  # the admin and dashboard routes read Redis directly
        return APIError(503, f"the routing state (Redis) is unavailable, retry shortly: {exc}", type="server_error",
                        headers={"Retry-After": "1"})
    return APIError(500, INTERNAL_MESSAGE, type="server_error")


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 becomes OpenAI's 400, naming the most specific bad field."""
    errors = list(exc.errors())
    if not errors:
        return APIError(400, "The request body is not valid.")
    if errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "")
        return APIError(400, f"We could not parse the JSON body of your request ({reason}). The body must be "
                             "valid JSON; see https://platform.openai.com/docs/api-reference.")
    # a union reports one error per member; the deepest one says what is actually wrong
    first = max(errors, key=lambda e: len(_fields(e.get("loc", ()))))
    loc = _fields(first.get("loc", ()))
    if not loc:
        if first.get("type") == "missing":
            return APIError(400, "The request body is missing: send a JSON object.")
        if first.get("type") == "value_error":  # a rule over the whole body (two fields that exclude each other)
            return APIError(400, f"{str(first.get('msg', 'invalid')).removeprefix('Value error, ')}.")
        return APIError(400, "The request body must be a JSON object, sent with Content-Type: application/json.")
    param = _param(loc)
    return APIError(400, f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", param=param)


def _fields(loc: Sequence[Any]) -> list[str | int]:
    """The field path in a pydantic error location, without "body" and without the union-member
    tags pydantic adds ("list[int]", or a content part's type after its index): not fields."""
    out: list[str | int] = []
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out.append(part)
        elif part == "body" or "[" in part or part in _TYPE_TAGS or part in _UNION_TAGS:
            continue
        elif part in CONTENT_PART_TAGS and i > 0 and isinstance(loc[i - 1], int) and i + 1 < len(loc):
            continue
        else:
            out.append(part)
    return out


_TYPE_TAGS = ("str", "int", "float", "bool", "none")
# the tags a body's kind is validated under (controlplane.api.tokenize): in an error's location, not fields
CHAT_BODY, PROMPT_BODY = "tokenize-chat", "tokenize-prompt"
_UNION_TAGS = (CHAT_BODY, PROMPT_BODY)


def _param(loc: list[str | int]) -> str:
    """["messages", 0, "content"] -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


_FASTAPI_BODY_ERROR = "There was an error parsing the body"


def _body_error(cause: BaseException) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return (f"The request body is not valid UTF-8 (byte {cause.start} is 0x{cause.object[cause.start]:02x}); "
                "send JSON encoded as UTF-8.")
    if isinstance(cause, RecursionError):
        return "The request body's JSON is nested too deeply to parse."
    return f"{_FASTAPI_BODY_ERROR}: {type(cause).__name__}."


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        return as_api_error(exc).response()

    async def invalid(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc).response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        cause = exc.__cause__
        if isinstance(cause, APIError):  # raised while FastAPI read the body (limits.BodyLimit)
            return cause.response()
        if isinstance(cause, ClientDisconnect):  # it left while sending its body: nobody reads this, and it
            return as_api_error(ClientGone("the client left while sending its body")).response()  # is no 400
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # the router's own: no such route
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif message == _FASTAPI_BODY_ERROR and cause is not None:  # it wraps what failed in that message
            message = _body_error(cause)
        err = APIError(exc.status_code, message, type="invalid_request_error" if exc.status_code < 500
                       else "server_error", headers=dict(exc.headers or {}))
        return err.response()

    for cls in (APIError, Overloaded, BackendError, InvalidRequestError, StateError, ClientGone):
        app.add_exception_handler(cls, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)


class ClientLeft(OSError):
    """A send to a client whose connection is closed (what every layer takes for the client gone)."""


def _transport_closed(exc: RuntimeError) -> bool:
    """uvloop's refusal to write to a closed transport. uvicorn checks for a disconnect before it writes, but
    misses one on a connection with pipelined requests (it marks only the newest request disconnected)."""
    return "the handler is closed" in str(exc)


class CatchAll:
    """Outermost guard: an unexpected exception becomes a logged, generic 500 in OpenAI's shape. A send to a
    client that is gone raises ``ClientLeft`` (an OSError) to the layers inside, and ends the request quietly.

    (Starlette's own ServerErrorMiddleware would answer too, but re-raises into the server.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            try:
                await send(message)
            except RuntimeError as exc:
                if not _transport_closed(exc):
                    raise
                raise ClientLeft(str(exc)) from None

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if isinstance(exc, ClientLeft) or (isinstance(exc, BaseExceptionGroup)
                                               and exc.split(ClientLeft)[1] is None):
                log.debug("%s %s: the client left before its answer was sent", scope.get("method"), scope.get("path"))
                return
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # the status line is gone; the server closes the connection
            await as_api_error(RuntimeError()).response()(scope, receive, send)
