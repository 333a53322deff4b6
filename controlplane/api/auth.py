"""API keys: with any configured, every /v1/*, /tokenize and /detokenize request needs
``Authorization: Bearer <key>`` (the tokenizer endpoints run the served model's chat template on a caller's
body, so they are part of the API a key guards).
The ops token (``api.ops_token``): when set, /metrics and /dashboard (the page and its data) need it, as
``Authorization: Bearer <token>`` (Prometheus's ``authorization`` block) or, for a browser opening the page,
``?token=<token>`` (the page then sends it as a header on its own requests).

A middleware rather than a dependency, so a request without a key is refused before its body is
read or parsed (an unauthenticated caller learns nothing about what the body should hold).
/health, /ready and /admin (which has its own token) are not under /v1.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Sequence
from urllib.parse import parse_qs, unquote_plus

from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.api.errors import APIError

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")
OPS_PATHS = ("/metrics", "/dashboard/api")
OPS_PAGES = ("/dashboard", "/dashboard/")  # the page itself; its static JS and CSS hold no data


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def _bearer(header: bytes | None) -> bytes | None:
    if header is None:
        return None
    scheme, _, token = header.partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def _matches(token: bytes | None, keys: Sequence[bytes]) -> bool:
    # compare against every key, so the time taken does not tell which one nearly matched
    return token is not None and sum(secrets.compare_digest(token, key) for key in keys) > 0


class BearerAuth:
    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys if k]

    def _allowed(self, header: bytes | None) -> bool:
        return _matches(_bearer(header), self.keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (not self.keys or scope["type"] != "http"
                or not any(_under(path, p) for p in PROTECTED_PREFIXES)):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization")
        if self._allowed(header):
            await self.app(scope, receive, send)
            return
        message = ("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'." if header is None
                   else "Incorrect API key provided.")
        err = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await err.response()(scope, receive, send)


class OpsAuth:
    """/metrics and /dashboard behind ``token`` (None: open). A refusal is a 401 that says how to send it."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.keys = [token.encode()] if token else []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = path in OPS_PAGES or any(_under(path, p) for p in OPS_PATHS)
        if not self.keys or scope["type"] != "http" or not guarded:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization")
        token = _bearer(header)
        if token is None:
            query = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
            token = query["token"][-1].encode() if query.get("token") else None
        if _matches(token, self.keys):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "/metrics and /dashboard need the ops token (api.ops_token): send "
                            "'Authorization: Bearer <token>', or open /dashboard?token=<token>",
                       code="invalid_ops_token", headers={"WWW-Authenticate": "Bearer"})
        await err.response()(scope, receive, send)


_QUERY = re.compile(r"\?[^\s#]*")


def _mask_query(match: re.Match[str]) -> str:
    """A query string with the value of every parameter that decodes to ``token`` (as ``parse_qs`` reads
    the ops token, ``%74oken`` included) shown as ``***``."""
    pairs = match.group(0)[1:].split("&")
    return "?" + "&".join(f"{p.split('=', 1)[0]}=***" if unquote_plus(p.split("=", 1)[0]) == "token" else p
                          for p in pairs)


def mask_query_tokens(text: str) -> str:
    return _QUERY.sub(_mask_query, text)


class QueryTokenMask(logging.Filter):
    """Masks ``token=`` query values (the ops token of ``/dashboard?token=...``) in the messages of the logger
    it is added to: uvicorn's access log writes each request's path with its query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(mask_query_tokens(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = mask_query_tokens(record.msg)
        return True


def mask_tokens_in_access_log(logger_name: str = "uvicorn.access") -> None:
    """Add ``QueryTokenMask`` to uvicorn's access logger (once; after uvicorn configured its logging)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, QueryTokenMask) for f in logger.filters):
        logger.addFilter(QueryTokenMask())
