"""API keys: with any configured, every /v1/* request needs ``Authorization: Bearer <key>``.

A middleware rather than a dependency, so a request without a key is refused before its body is
read or parsed (an unauthenticated caller learns nothing about what the body should hold).
/health, /ready and /admin (which has its own token) are not under /v1.
"""

from __future__ import annotations

import secrets
from typing import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.api.errors import APIError

PROTECTED_PREFIX = "/v1"


class BearerAuth:
    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys if k]

    def _allowed(self, header: bytes | None) -> bool:
        if header is None:
            return False
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return False
        token = token.strip()
        # compare against every key, so the time taken does not tell which one nearly matched
        return sum(secrets.compare_digest(token, key) for key in self.keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (not self.keys or scope["type"] != "http"
                or not (path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/"))):
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
