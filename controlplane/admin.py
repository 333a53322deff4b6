"""The admin API: pool status and scaling, behind the admin token.

  GET  /admin/pools                    every pool: target replicas, ready replicas, each worker's load
  PUT  /admin/pools/{pool}             {"replicas": N}: set the target; the pool manager reconciles. 0 for a
                                       pool the model needs is refused (409) unless {"force": true}
  POST /admin/workers/{worker_id}/drain    stop routing to a worker; its in-flight requests finish
  DELETE /admin/workers/{worker_id}/drain  undo it: the worker takes new work again (409 while a
                                           scale-down is stopping it)

Targets live in Redis, so ``epd scale`` from any machine that reaches the API takes effect, and the
pool manager's reconcile loop is the only thing that starts or stops replicas. Scaling one pool
never touches another.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio.to_thread
from fastapi import APIRouter, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.code_version import code_version
from controlplane.state.client import StateConnection
from controlplane.state.keys import InvalidKeyPart, Pool
from controlplane.state.pools import MAX_REPLICAS, PoolTargets
from controlplane.state.registry import WorkerRecord, WorkerRegistry

if TYPE_CHECKING:
    from controlplane.pools.status import PendingReplica
    from kvtransfer.auth import TransferSecurity


@dataclass(frozen=True)
class WorkerSummary:
    worker_id: str
    address: str
    draining: bool
    running: int
    queued_tokens: int
    free_kv_blocks: int
    total_kv_blocks: int
    pid: int  # on the host in ``address``; 0: not said
    version: str  # the code it runs (``code_version``); "": not said
    preemptions: int = 0  # sequences its engine preempted since it started
    prefix_cache_queries: int = 0  # prompt tokens its engine looked up in its prefix cache since it started
    prefix_cache_hits: int = 0  # of which their KV was cached


@dataclass(frozen=True)
class PoolView:
    """A pool as /admin/pools, ``epd status`` and the dashboard show it. ``pending``: replicas asked for and
    not serving yet, each with its reason (``controlplane.pools.status.PendingReplica``). ``problem``: why
    the pool is not at its target when no pending replica says it (the last failed start), else None.
    ``not_needed``: why this deployment runs no such pool (a text-only model's encode pool), else None."""

    pool: str
    target: int | None
    ready: int
    workers: list[WorkerSummary]
    pending: tuple[PendingReplica, ...] = ()
    problem: str | None = None
    not_needed: str | None = None


class PoolStarts(Protocol):
    """What the pool manager of this process says about replicas it is starting or stopping (``PoolManager``)."""

    def pending(self, pool: str) -> tuple[PendingReplica, ...]: ...

    def problem(self, pool: str) -> str | None: ...

    def stopping(self, worker_id: str) -> bool: ...


def pools_status(conn: StateConnection, registry: WorkerRegistry, starts: PoolStarts | None = None,
                 not_needed: Mapping[str, str] | None = None) -> list[PoolView]:
    """``not_needed``: pool -> why this deployment runs none (``serve.fit_pools``)."""
    targets = PoolTargets(conn).all_targets()
    out = []
    for pool in Pool:
        live = registry.live_workers(pool)
        workers = [WorkerSummary(r.info.worker_id, r.info.address, r.info.draining, r.info.load.running,
                              r.info.load.queued_tokens, r.info.load.free_kv_blocks, r.info.load.total_kv_blocks,
                              r.info.pid, r.info.version, r.info.load.preemptions,
                              r.info.load.prefix_cache_queries, r.info.load.prefix_cache_hits)
                   for r in live]
        pending = starts.pending(pool.value) if starts is not None else ()
        problem = starts.problem(pool.value) if starts is not None else None
        out.append(PoolView(pool.value, targets.get(pool), sum(not w.draining for w in workers), workers,
                            pending, problem, (not_needed or {}).get(pool.value)))
    return out


def _worker_rpc(registry: WorkerRegistry, security: TransferSecurity, method: str) -> Callable[[str], str | None]:
    """Call ``method`` (Drain or Resume) on a live worker's own service: None when it answered, else why not."""
    import grpc

    from epd.worker.v1 import worker_pb2 as wpb
    from epd.worker.v1 import worker_pb2_grpc as wgrpc

    # the generated stubs are untyped: their methods are Any
    stubs: dict[str, Callable[[grpc.Channel], Any]] = {
        "encode": wgrpc.EncodeWorkerStub, "prefill": wgrpc.PrefillWorkerStub, "decode": wgrpc.DecodeWorkerStub}
    request = wpb.DrainRequest() if method == "Drain" else wpb.ResumeRequest()

    def call(worker_id: str) -> str | None:
        record = registry.find(worker_id)
        if record is None:
            return "it holds no live lease"
        with security.open_channel(record.info.address) as channel:
            try:
                getattr(stubs[record.info.pool.value](channel), method)(
                    request, metadata=security.call_metadata(), timeout=5)
            except grpc.RpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
        return None
    return call


def drain_over_rpc(registry: WorkerRegistry, security: TransferSecurity) -> Callable[[str], bool]:
    """``on_drain`` for a live deployment: tell the worker itself (its Drain RPC) to refuse new work."""
    call = _worker_rpc(registry, security, "Drain")
    return lambda worker_id: call(worker_id) is None  # routing already skips it; the worker may be gone


def resume_over_rpc(registry: WorkerRegistry, security: TransferSecurity) -> Callable[[str], str | None]:
    """``on_resume`` for a live deployment: tell the worker itself (its Resume RPC) to take new work again;
    None when it did, else why not."""
    return _worker_rpc(registry, security, "Resume")


class ScaleBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "2" or 2.0 is a 400, as on /v1
    replicas: int = Field(ge=0, le=MAX_REPLICAS)
    force: bool = False  # scale to 0 a pool the model needs


def _scale_body(raw: bytes) -> ScaleBody:
    """The body of a scale request, read only after the token is checked (so a caller without it
    learns nothing about what the body should hold); errors take the API's 400 path."""
    if not raw.strip():
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        return ScaleBody.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def admin_router(conn: StateConnection, registry: WorkerRegistry, admin_token: str,
                 on_scale: Callable[[str, int], None] | None = None,
                 on_drain: Callable[[str], bool] | None = None,
                 on_resume: Callable[[str], str | None] | None = None,
                 fixed_pools: dict[str, str] | None = None, starts: PoolStarts | None = None) -> APIRouter:
    """``fixed_pools``: pool -> why it cannot be scaled in this deployment (409 with that reason).
    ``starts``: the pool manager, for replicas not serving yet and why (None: none shown)."""
    fixed = dict(fixed_pools or {})
    version = code_version()  # what this process loaded: taken now, before the files on disk can change
    router = APIRouter(prefix="/admin")
    expected = f"Bearer {admin_token}".encode()

    def check(authorization: str | None) -> None:
        if not hmac.compare_digest((authorization or "").encode(), expected):
            raise HTTPException(401, "missing or wrong admin token (Authorization: Bearer <admin token>)",
                                headers={"WWW-Authenticate": "Bearer"})

    @router.get("/pools")
    def get_pools(authorization: str | None = Header(None)) -> dict:
        check(authorization)
        return {"pools": [asdict(p) for p in pools_status(conn, registry, starts, fixed)], "version": version}

    @router.put("/pools/{pool}", openapi_extra={"requestBody": {"content": {"application/json": {
        "schema": ScaleBody.model_json_schema()}}, "required": True}})
    async def put_pool(pool: str, request: Request, authorization: str | None = Header(None)) -> dict:
        check(authorization)
        body = _scale_body(await request.body())
        try:
            parsed = Pool(pool)
        except ValueError:
            raise HTTPException(404, f"unknown pool {pool!r}; pools are encode, prefill and decode") from None
        if parsed.value in fixed:
            raise HTTPException(409, fixed[parsed.value])
        if body.replicas == 0 and not body.force:
            raise HTTPException(409, f"the model needs the {parsed.value} pool: with 0 replicas every request "
                                     f"that needs it fails (503) until it is scaled up again. To do it anyway: "
                                     f"epd scale {parsed.value} 0 --force (API: {{\"replicas\": 0, \"force\": true}})")

        def scale() -> None:  # Redis and the pool manager: off the event loop
            PoolTargets(conn).set_target(parsed, body.replicas)
            if on_scale is not None:
                on_scale(parsed.value, body.replicas)
        await anyio.to_thread.run_sync(scale)
        return {"pool": parsed.value, "target": body.replicas}

    def live_worker(worker_id: str) -> WorkerRecord:
        """The registry's record of ``worker_id``; 404 when none is live (an id no worker can have included)."""
        try:
            record = registry.find(worker_id)
        except InvalidKeyPart as exc:
            raise HTTPException(404, f"no live worker {worker_id!r}: {exc}") from None
        if record is None:
            raise HTTPException(404, f"no live worker {worker_id!r}")
        return record

    @router.post("/workers/{worker_id}/drain")
    def drain(worker_id: str, authorization: str | None = Header(None)) -> dict:
        check(authorization)
        record = live_worker(worker_id)
        registry.set_draining(worker_id, record.info.pool)
        drained = on_drain(worker_id) if on_drain is not None else False
        return {"worker_id": worker_id, "draining": True, "stopped": drained}

    @router.delete("/workers/{worker_id}/drain")
    def resume(worker_id: str, authorization: str | None = Header(None)) -> dict:
        """Undo a drain. The worker itself takes work again first, then routing is told, so no request is
        routed to a worker that still refuses it."""
        check(authorization)
        record = live_worker(worker_id)
        stopping = HTTPException(409, f"worker {worker_id} is being stopped by a scale-down of the "
                                      f"{record.info.pool.value} pool; scale the pool up for another replica")
        if starts is not None and starts.stopping(worker_id):
            raise stopping
        why = on_resume(worker_id) if on_resume is not None else None
        if why is not None:
            raise HTTPException(502, f"worker {worker_id} did not resume ({why}); routing still skips it")
        registry.set_draining(worker_id, record.info.pool, False)
        if starts is not None and starts.stopping(worker_id):  # a scale-down chose it meanwhile: it drains again
            registry.set_draining(worker_id, record.info.pool)
            if on_drain is not None:
                on_drain(worker_id)
            raise stopping
        return {"worker_id": worker_id, "draining": False}

    return router
