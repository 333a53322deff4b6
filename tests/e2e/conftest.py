"""The HTTP API over three real workers (in-process gRPC servers) and a fixed route.

``DispatchBackend`` is a stand-in for the scheduler: the real Dispatcher over one Route, with the
gRPC statuses mapped the way the scheduler maps them. It records each request's tokens, so tests
compare token ids, not only text, with the single-process reference.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

import grpc
import pytest

from controlplane.api import create_app
from controlplane.backend import BackendError, Chunk, ModelInfo, Overloaded
from controlplane.dispatch import Dispatcher, DispatchError, Route, WorkerRequest
from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from workers.run import RunningWorker, start_worker
from workers.runtime.default_model import DEFAULT_MODEL_NAME
from workers.runtime.engine import EngineConfig
from workers.runtime.loader import LoadedModel

from http_helpers import serve_app

API_KEY = "sk-e2e-" + secrets.token_hex(8)
_CLIENT_FAULTS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


class DispatchBackend:
    """Implements controlplane.backend.Backend with a Dispatcher and one fixed Route."""

    def __init__(self, bundle: LoadedModel, dispatcher: Dispatcher, route: Route) -> None:
        assert bundle.tokenizer is not None and bundle.vision is not None
        self.model = ModelInfo(DEFAULT_MODEL_NAME, bundle.tokenizer, bundle.config.max_position_embeddings,
                               bundle.image_token_id, bundle.vision.config.num_image_tokens, bundle.eos_token_ids)
        self.dispatcher, self.route = dispatcher, route
        self.tokens: dict[str, list[int]] = {}  # request id -> every token id relayed
        self.abandoned: list[str] = []  # request ids closed before their last chunk

    def ready(self) -> bool:
        return True

    def degraded(self) -> str | None:
        return None

    def generate(self, request: WorkerRequest) -> Iterator[Chunk]:
        tokens = self.tokens.setdefault(request.request_id, [])
        finished = False
        try:
            with closing(self.dispatcher.run(request, self.route)) as stream:
                for c in stream:
                    tokens.extend(c.token_ids)
                    finished = c.finished
                    yield Chunk.from_wire(c)
        except DispatchError as exc:
            if exc.code in _CLIENT_FAULTS:
                raise BackendError(str(exc), status=400, kind="invalid_request_error") from None
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise Overloaded(str(exc), retry_after_s=1.0, reason="queue_full") from None
            raise BackendError(str(exc), status=502) from None
        finally:
            if not finished:
                self.abandoned.append(request.request_id)


@dataclass
class Stack:
    bundle: LoadedModel
    workers: dict[str, RunningWorker]
    backend: DispatchBackend
    security: TransferSecurity
    base_url: str  # http://127.0.0.1:PORT/v1
    api_key: str

    def assert_workers_idle(self, within_s: float = 5.0) -> None:
        """Every block free, nothing reserved, running or waiting, on decode and prefill."""
        deadline = time.monotonic() + within_s
        while True:
            states = {pool: self._status(pool, stub) for pool, stub in
                      (("decode", wgrpc.DecodeWorkerStub), ("prefill", wgrpc.PrefillWorkerStub))}
            idle = all((s.kv_blocks_free, s.reservations, s.running, s.waiting) == (s.kv_blocks_total, 0, 0, 0)
                       for s in states.values())
            if idle:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"workers still busy: {states}")
            time.sleep(0.05)

    def _status(self, pool: str, stub_cls: type) -> wpb.WorkerStatus:
        with self.security.open_channel(self.workers[pool].address) as ch:
            return stub_cls(ch).Status(wpb.StatusRequest(), metadata=self.security.call_metadata(), timeout=5)


@pytest.fixture(scope="session")
def e2e_stack(default_bundle: LoadedModel) -> Iterator[Stack]:
    security = TransferSecurity(token=secrets.token_urlsafe(24))
    codecs = ("fp32",) * default_bundle.config.num_layers
    workers = {pool: start_worker(pool, default_bundle, security, codecs=codecs,
                                  config=EngineConfig(kv_cache_bytes=64 * 2**20))
               for pool in ("encode", "prefill", "decode")}
    dispatcher = Dispatcher(security)
    route = Route(workers["decode"].address, workers["prefill"].address, workers["encode"].address)
    backend = DispatchBackend(default_bundle, dispatcher, route)
    try:
        with serve_app(create_app(backend, api_keys=[API_KEY])) as base:
            yield Stack(default_bundle, workers, backend, security, f"{base}/v1", API_KEY)
    finally:
        dispatcher.close()
        for w in workers.values():
            w.stop()
