"""The HTTP ingress: OpenAI-compatible endpoints over one ``Backend``.

    client ──HTTP──> BearerAuth ──> route ──> prompts.prepare_* ──WorkerRequest──> Relay (threads)
                                                                                 └─> backend.generate()
    client <──JSON / SSE── shapes <── streaming.collect / sse_events <── Chunk ─────────┘

A client that leaves cancels its request (its ``Cancellation``), and the workers abort it at once, even
while it waits for a token: ``streaming.client_watched`` notices until the status line goes out (a streamed
answer's goes with its first token), then ``streaming.EventStream``.

A request is validated, tokenised and checked against the context before the backend sees it.
The backend's first chunk is awaited before the status line, so admission failures (429) and
stage failures (4xx/5xx) keep their status even with ``stream: true``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import anyio.to_thread
from fastapi import APIRouter, FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from controlplane.api.auth import BearerAuth, OpsAuth
from controlplane.api.errors import CatchAll, as_api_error, install_error_handlers
from controlplane.api.limits import MAX_BODY_BYTES, BodyLimit, OffLoopJSONRoute, prepare_off_loop
from controlplane.api.logprobs import TokenText
from controlplane.api.models import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, StreamOptions
from controlplane.api.prompts import check_model, echo_text, prepare_chat, prepare_completion
from controlplane.api.relay import Relay, ThreadLanes
from controlplane.api.shapes import ChatShape, CompletionShape, Shape
from controlplane.api.streaming import EventStream, client_watched, collect, sse_events
from controlplane.api.tokenize import tokenize_router
from controlplane.backend import Backend
from controlplane.cancellation import ClientGone
from controlplane.dispatch import WorkerRequest
from controlplane.observability import server_timing
from controlplane.observability.http import T0_KEY, ObservabilityMiddleware, fastapi_kwargs, watch
from controlplane.observability.metrics import bind_model

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's status for a client that left before the answer; nobody reads it


def create_app(backend: Backend, api_keys: Sequence[str] = (), admin: APIRouter | None = None, *,
               relay_threads: int = 256, relay_wait_s: float | None = None, routers: Sequence[APIRouter] = (),
               max_body_bytes: int = MAX_BODY_BYTES, ops_token: str | None = None,
               unhealthy: Callable[[], str | None] | None = None, cors_origins: Sequence[str] = (),
               sse_keepalive_s: float = 15.0) -> FastAPI:
    """The ingress app. ``api_keys``: bearer keys for /v1/*, /tokenize and /detokenize (empty: open).
    ``admin``: a router mounted as is (it guards itself). ``relay_threads``: threads that may wait on backend
    chunks (per lane, ``relay.ThreadLanes``); ``relay_wait_s``: how long a request may wait for one to start
    on (then 429).
    ``routers``: more routers mounted as they are (the dashboard). ``GET /metrics`` is always served.
    ``max_body_bytes``: a larger request body is a 413 (``limits.BodyLimit``). ``ops_token``: /metrics and
    /dashboard need it (``auth.OpsAuth``; None: open). ``unhealthy``: why the process should be restarted (None:
    healthy), asked by ``GET /health``, which then answers 503 with that reason (a liveness probe restarts it).
    ``cors_origins``: web origins (or "*") whose pages may call the API from a browser; a preflight is answered
    before any key is asked for (browsers send none with it), and no cookie is ever honoured (the API reads
    bearer keys only). ``sse_keepalive_s``: a streamed answer that sends no token this long sends an SSE comment
    (``streaming.KEEPALIVE``), and again after each such silence, so proxies keep the stream open (0: never)."""
    app = FastAPI(title="epd", summary="OpenAI-compatible API over disaggregated encode/prefill/decode",
                  docs_url=None, redoc_url=None, **fastapi_kwargs())
    install_error_handlers(app)
    bind_model(backend.model.name)  # the model_name label of every epd: series
    lanes = ThreadLanes(relay_threads, relay_wait_s)
    started = int(time.time())

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD: probes that send it
    async def health() -> Response:
        reason = unhealthy() if unhealthy is not None else None
        if reason is not None:
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.api_route("/ready", methods=["GET", "HEAD"], include_in_schema=False)
    async def ready() -> Response:
        try:
            ok = await anyio.to_thread.run_sync(backend.ready)  # may ask Redis; off the loop
        except Exception:
            log.exception("backend.ready() failed")
            ok = False
        body = {"status": "ready" if ok else "not ready"}
        degraded = backend.degraded()
        if degraded is not None:  # still serving (200 when ready), but an operator should know why it is odd
            body["degraded"] = degraded
        return JSONResponse(body, status_code=200 if ok else 503)

    v1 = APIRouter(prefix="/v1", route_class=OffLoopJSONRoute)  # a large body's JSON parsed off the loop

    def card() -> ModelCard:
        return ModelCard(id=backend.model.name, created=started, max_model_len=backend.model.max_model_len)

    @v1.get("/models")
    async def list_models() -> Response:
        return _json(ModelList(data=[card()]).model_dump_json())

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        check_model(model_id, backend.model)
        return _json(card().model_dump_json())

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        worker_request = await prepare_off_loop(request, lambda: prepare_chat(body, backend.model))
        shape = ChatShape(f"chatcmpl-{_hex(worker_request)}", backend.model.name, _tokens(worker_request))
        return await _answer(worker_request, shape, body.stream, body.stream_options, request)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        def prepare() -> tuple[WorkerRequest, str | None]:  # a token-id prompt's echo is decoded: off the loop too
            prepared = prepare_completion(body, backend.model)
            return prepared, echo_text(body, prepared, backend.model) if body.echo else None

        worker_request, echo = await prepare_off_loop(request, prepare)
        shape = CompletionShape(f"cmpl-{_hex(worker_request)}", backend.model.name, _tokens(worker_request),
                                echo=echo, prompt_ids=tuple(worker_request.prompt_ids))
        return await _answer(worker_request, shape, body.stream, body.stream_options, request)

    token_text = TokenText(backend.model.tokenizer)

    def _tokens(worker_request: WorkerRequest) -> TokenText | None:
        p = worker_request.params
        return token_text if p.logprobs is not None or p.prompt_logprobs is not None else None

    async def _answer(worker_request: WorkerRequest, shape: Shape, stream: bool | None,
                      stream_options: StreamOptions | None, request: Request) -> Response:
        chunks = watch(Relay(backend, worker_request, lanes).chunks(), worker_request.request_id,
                       request.scope["path"], getattr(request.state, T0_KEY, None),  # not .url: it parses
                       streamed=bool(stream), status_of=lambda exc: as_api_error(exc).status)
        try:
            async with client_watched(request.receive, worker_request.cancel):
                first = await anext(chunks)  # Overloaded / BackendError here keep their own status
                if not stream:
                    whole = await collect(first, chunks)
        except ClientGone:  # aborted on the workers already
            return Response(status_code=CLIENT_CLOSED)
        if stream:
            include_usage = stream_options is not None and stream_options.include_usage
            return EventStream(sse_events(first, chunks, shape, include_usage), sse_keepalive_s,
                               on_leave=worker_request.cancel.cancel)
        last = whole.last
        if _tokens(worker_request) is None:
            response = _json(shape.whole(whole).model_dump_json())
        else:  # a token's text per id, for every token (and the prompt's): off the loop
            response = _json(await anyio.to_thread.run_sync(lambda: shape.whole(whole).model_dump_json()))
        if last.engine_seconds > 0:
            # W3C Server-Timing: what the worker's engine spent on this request (one engine ran it whole),
            # so a client can tell compute from everything else (epd bench controlplane's added latency).
            response.headers[server_timing.HEADER] = server_timing.engine_header(last.engine_seconds)
        return response

    app.include_router(v1)
    app.include_router(tokenize_router(backend.model))  # vLLM's /tokenize and /detokenize, beside /v1

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        from controlplane.observability.metrics import CONTENT_TYPE, exposition

        body = await anyio.to_thread.run_sync(exposition)  # pool gauges may read Redis; off the loop
        return Response(body, media_type=CONTENT_TYPE)

    for router in routers:
        app.include_router(router)
    if admin is not None:
        app.include_router(admin)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(BearerAuth, api_keys=list(api_keys))  # outside BodyLimit: no key, no size hint
    app.add_middleware(OpsAuth, token=ops_token)
    if cors_origins:  # outside the key checks: a browser's preflight carries no key
        # any request header: OpenAI's JavaScript SDK sends its own (x-stainless-*); credentials stay off
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["Retry-After", "Server-Timing"],
                           allow_credentials=False, max_age=600)
    app.add_middleware(CatchAll)
    app.add_middleware(ObservabilityMiddleware)  # added last: outermost, so it sees every status sent
    return app


def _json(body: str) -> Response:
    return Response(body, media_type="application/json")


def _hex(request: WorkerRequest) -> str:
    """The response id's suffix: the request's uuid, so logs and journals join on it."""
    return request.request_id.replace("-", "")
