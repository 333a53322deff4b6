"""Authentication for every KV and embedding RPC: a shared bearer token, mTLS, or both.

Server side, ``TokenAuthInterceptor`` answers UNAUTHENTICATED to a call without the right
``authorization: Bearer <token>`` metadata before the handler sees any data. With mTLS the server
requires a client certificate signed by the configured CA, so a client without one cannot even
complete the TLS handshake. Client side, ``open_channel`` builds the matching channel and
``call_metadata`` the token header. Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvtransfer.options import CHANNEL_OPTIONS


class SecurityConfigError(ValueError):
    """The transfer's credentials are incomplete or unreadable."""


@dataclass(frozen=True)
class TransferSecurity:
    token: str | None = None
    tls_ca: Path | None = None  # PEM of the CA that signs both sides' certificates
    tls_cert: Path | None = None  # this side's certificate chain (PEM)
    tls_key: Path | None = None  # this side's private key (PEM)
    tls_server_name: str | None = None  # expected name in the server certificate, when not the target host
    allow_insecure: bool = False  # no credential at all: only for tests that show the refusal

    def __post_init__(self) -> None:
        tls = (self.tls_ca, self.tls_cert, self.tls_key)
        if any(tls) and not all(tls):
            raise SecurityConfigError("mTLS needs all three of tls_ca, tls_cert and tls_key")
        if self.token is not None and len(self.token) < 16:
            raise SecurityConfigError("the KV-transfer token must be at least 16 characters")
        if not self.token and not all(tls) and not self.allow_insecure:
            raise SecurityConfigError("KV transfer needs a credential: set a token, or tls_ca/tls_cert/tls_key")

    def __repr__(self) -> str:  # never print the token
        return (f"TransferSecurity(token={'<set>' if self.token else None}, tls={'on' if self.mtls else 'off'}, "
                f"allow_insecure={self.allow_insecure})")

    @property
    def mtls(self) -> bool:
        return self.tls_ca is not None

    def _read(self, path: Path | None, what: str) -> bytes:
        try:
            return Path(path).read_bytes()  # type: ignore[arg-type]  # called only for a configured path
        except OSError as exc:
            raise SecurityConfigError(f"cannot read the {what} at {path}: {exc.strerror}") from None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.mtls:
            return None
        pair = (self._read(self.tls_key, "TLS key"), self._read(self.tls_cert, "TLS certificate"))
        return grpc.ssl_server_credentials([pair],
                                           root_certificates=self._read(self.tls_ca, "TLS CA"),
                                           require_client_auth=True)

    def ssl_context(self, server_side: bool) -> ssl.SSLContext | None:
        """The same mTLS material as a Python ``ssl`` context, for the bulk TCP transport (kvtransfer.bulk):
        TLS 1.2+, the CA verifies the peer's certificate on both sides. None without mTLS."""
        if not self.mtls:
            return None
        purpose = ssl.Purpose.CLIENT_AUTH if server_side else ssl.Purpose.SERVER_AUTH
        try:
            ctx = ssl.create_default_context(purpose, cafile=str(self.tls_ca))
            ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        except (OSError, ssl.SSLError) as exc:
            raise SecurityConfigError(f"cannot load the TLS CA, certificate or key: {exc}") from None
        if server_side:
            ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: a client without a certificate is refused
        return ctx

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenAuthInterceptor(self.token)] if self.token else []

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def open_channel(self, target: str, options: tuple[tuple[str, Any], ...] = CHANNEL_OPTIONS) -> grpc.Channel:
        if not self.mtls:
            return grpc.insecure_channel(target, options=options)
        creds = grpc.ssl_channel_credentials(root_certificates=self._read(self.tls_ca, "TLS CA"),
                                             private_key=self._read(self.tls_key, "TLS key"),
                                             certificate_chain=self._read(self.tls_cert, "TLS certificate"))
        if self.tls_server_name:
            options = options + (("grpc.ssl_target_name_override", self.tls_server_name),)
        return grpc.secure_channel(target, creds, options=options)

    def add_port(self, server: grpc.Server, address: str) -> int:
        creds = self.server_credentials()
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        return port


class ChannelCache:
    """One channel per target, opened with ``security`` on first use and reused (never one per call)."""

    def __init__(self, security: TransferSecurity) -> None:
        self.security = security
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, target: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(target)
            if ch is None:
                ch = self._channels[target] = self.security.open_channel(target)
            return ch

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        presented = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(presented, str):
            presented = presented.encode()
        if hmac.compare_digest(presented, self._expected):
            return handler
        return _refusal(handler, "missing or wrong KV-transfer credential (authorization: Bearer <token>)")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = dict(request_deserializer=None, response_serializer=None)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
