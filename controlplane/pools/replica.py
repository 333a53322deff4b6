"""What runs inside one pool replica's process: the worker built from settings, and its lease.

  1. ``build_worker``   loads the checkpoint, resolves the per-layer KV codecs and starts the
                        worker's gRPC server (workers.run.start_worker) on ``host:0``.
  2. ``Lease.start``    registers the worker in the Redis registry, then heartbeats every
                        ``ttl / 3`` seconds from a daemon thread with the load its own service's
                        Status reports. A lost lease (Redis restarted, a long pause) is registered
                        again; an unreachable Redis is retried at the next beat.
  3. ``Lease.stop``     stops beating first (so nothing re-registers), then deregisters.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path

from controlplane.code_version import code_version
from controlplane.settings import PoolSettings, Settings
from controlplane.state import StateError, WorkerInfo, WorkerLoad, WorkerNotRegistered, WorkerRegistry
from controlplane.state.keys import parse_pool
from epd.worker.v1 import worker_pb2 as wpb
from kvtransfer.auth import TransferSecurity
from workers.run import Pool, RunningWorker, start_worker
from workers.runtime.loader import LoadedModel

log = logging.getLogger(__name__)

# Fixed text for the "auto" codec policy: every replica calibrates on the same prompts, so prefill and
# decode workers of one deployment resolve the same codecs (the KV handshake rejects a mismatch).
CALIBRATION_TEXTS = (
    "The scheduler reserves cache blocks on the decode worker before prefill starts.",
    "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.",
    "Please write a short poem about the sea, the wind, the stars and the long night.",
    "def main(): return sum(x * x for x in range(10))  # a line of code",
)


def model_dir(settings: Settings) -> Path:
    """The checkpoint folder to serve: ``settings.model``, else the built-in demo model (written once)."""
    if settings.model is not None:
        return settings.model
    from workers.runtime.default_model import ensure_default_checkpoint
    return ensure_default_checkpoint()


def security_for(settings: Settings, token: str | None) -> TransferSecurity:
    t = settings.transfer
    return TransferSecurity(token=token or None, tls_ca=t.tls_ca, tls_cert=t.tls_cert, tls_key=t.tls_key)


def calibration_prompts(bundle: LoadedModel, block_size: int) -> list[list[int]]:
    """The fixed prompts, each repeated to at least two full KV blocks (64 tokens or more)."""
    length = max(64, 2 * block_size)
    prompts = []
    for i, text in enumerate(CALIBRATION_TEXTS):
        base = (bundle.tokenizer.encode(text) if bundle.tokenizer is not None
                else [(i * 31 + j) % bundle.config.vocab_size for j in range(32)])
        prompts.append((base * (length // len(base) + 1))[:length])
    return prompts


def resolve_pool_codecs(spec: str, bundle: LoadedModel, pool: PoolSettings) -> tuple[str, ...]:
    """The codec per layer for ``spec``. "auto" runs the calibration prompts on a throwaway engine with a KV
    pool just big enough for them and no CUDA graphs (on a GPU, a pool sized from free memory and the graphs'
    capture would double the replica's start-up, all to be thrown away); explicit policies need no engine."""
    import dataclasses

    from kvtransfer.policy import ExplicitPolicy, parse_policy
    from workers.prefill.calibrate import resolve_codecs
    from workers.runtime.engine import Engine
    from workers.runtime.kv_cache import KVCacheSpec

    policy = parse_policy(spec)
    cfg = bundle.config
    if isinstance(policy, ExplicitPolicy):
        return policy.resolve(cfg.num_layers)
    prompts = calibration_prompts(bundle, pool.engine.block_size)
    kv = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pool.engine.block_size)
    blocks = sum(len(p) // kv.block_size + 2 for p in prompts)  # each prompt and its sampled token, whole blocks
    config = dataclasses.replace(pool.engine.engine_config(), cuda_graphs=False, warmup=False,
                                 kv_cache_bytes=blocks * kv.layer_bytes_per_block("float32") * cfg.num_layers)
    engine = Engine(bundle.model, bundle.tokenizer, config, bundle.eos_token_ids)
    try:
        return resolve_codecs(spec, engine, prompts).codecs
    finally:
        del engine
        if bundle.model.device.type == "cuda":
            import torch
            torch.cuda.empty_cache()  # the real engine sizes its pool from free memory next


def reserved_device(ps: PoolSettings) -> str | None:
    """For a replica that sees every GPU of its node (``PoolSettings.sees_host_gpus``; call inside the Ray
    actor): its engine device mapped onto the GPU(s) Ray reserved for it. None for any other replica."""
    if not ps.sees_host_gpus:
        return None
    import os

    import ray

    from controlplane.ray_env import reserved_cuda_device
    return reserved_cuda_device(ps.engine.device, ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                                max(1, int(ps.num_gpus)))


def build_worker(pool: Pool, settings: Settings, folder: Path, security: TransferSecurity,
                 host: str, device: str | None = None) -> RunningWorker:
    """Load the model and start ``pool``'s gRPC worker on ``host`` (a free port). ``device``, when given,
    replaces the pool's ``engine.device`` (a replica that sees every GPU of its node runs on the one Ray
    reserved for it) and becomes this thread's current CUDA device."""
    import torch

    from workers.runtime.engine import DTYPES
    from workers.runtime.loader import load_model

    ps = settings.pool(pool)
    if device is not None:
        ps = ps.model_copy(update={"engine": ps.engine.model_copy(update={"device": device})})
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
    if ps.engine.threads:
        torch.set_num_threads(ps.engine.threads)
    from controlplane.observability.deploy import configure_process
    configure_process(settings.observability, f"epd-{pool}")  # spans of traced RPCs go where OTEL_* says
    colocated = settings.mode == "colocated" and pool == "decode"
    # a disaggregated decode worker never sees an image; prefill keeps the encoder for its fingerprint
    # (embedding handshake), on the CPU; an encode worker holds no text model; a colocated worker does it all
    bundle = load_model(folder, dtype=DTYPES[ps.engine.dtype], device=ps.engine.device,
                        with_vision=pool != "decode" or colocated, with_text=pool != "encode",
                        vision_device="cpu" if pool == "prefill" else None)
    codecs = (None if pool == "encode" or colocated
              else resolve_pool_codecs(settings.wire_codec_policy(), bundle, ps))
    return start_worker(pool, bundle, security, config=ps.engine.engine_config(), codecs=codecs,
                        store=settings.transfer.decode_store, transport=settings.transfer.transport,
                        host=host, port=0, max_streams=settings.transfer.max_streams, colocated=colocated,
                        transfer_timeout_s=settings.transfer.timeout_s,
                        stream_budget_bytes=settings.transfer.stream_budget_bytes,
                        sender_budget_bytes=settings.transfer.sender_budget_bytes,
                        embedding_cache_bytes=ps.embedding_cache_bytes)


@functools.cache
def wire_digest() -> str:
    """The wire protocol this process's code speaks, as a short digest of the worker and KV-transfer services'
    compiled proto descriptors. The control plane and every replica must speak the same one: where they do
    not (Ray worker nodes left on another epd image), a field can mean another thing on each side."""
    import hashlib

    from epd.kvtransfer.v1 import kvtransfer_pb2

    h = hashlib.sha256(wpb.DESCRIPTOR.serialized_pb)
    h.update(kvtransfer_pb2.DESCRIPTOR.serialized_pb)
    return h.hexdigest()[:12]


class WireMismatch(Exception):
    """A replica's code speaks another wire protocol than its control plane's."""


def check_wire(theirs: str | None, ours: str, who: str) -> None:
    """Raise WireMismatch, in words an operator can act on, unless ``theirs`` (``who``'s wire digest) is ``ours``
    (the control plane's)."""
    if theirs != ours:
        raise WireMismatch(f"{who} runs epd code that speaks another wire protocol ({theirs}) than the control "
                           f"plane ({ours}): its Ray node runs another epd image (an image upgrade not yet rolled "
                           f"out to running Ray pods?); replace those pods so every node runs the control plane's "
                           f"image")


def worker_status(worker: RunningWorker) -> wpb.WorkerStatus:
    """The worker's own Status RPC, called in process (it reads no call context)."""
    return worker.service.Status(wpb.StatusRequest(), None)  # type: ignore[attr-defined]  # each concrete service has Status


def queued_tokens(worker: RunningWorker) -> int:
    """Prompt tokens waiting in the engine. WorkerStatus carries only a request count, so this reads the
    engine's queue in process; an encode worker has no engine."""
    if worker.pool == "encode":
        return 0
    waiting = list(worker.service.engine.scheduler.waiting)  # type: ignore[attr-defined]  # non-encode services have an engine
    return sum(max(0, seq.num_tokens - seq.num_computed) for seq in waiting)


class Lease:
    """Keeps one worker registered while it runs."""

    def __init__(self, registry: WorkerRegistry, worker: RunningWorker) -> None:
        self.registry = registry
        self.worker = worker
        self.interval_s = registry.ttl / 3
        self._version = code_version()
        self._stop = threading.Event()
        self._last_ok = 0.0
        self._thread = threading.Thread(target=self._run, name="lease-heartbeat", daemon=True)

    def _info(self) -> WorkerInfo:
        s = worker_status(self.worker)
        load = WorkerLoad(queued_tokens=queued_tokens(self.worker), free_kv_blocks=s.kv_blocks_free,
                          total_kv_blocks=s.kv_blocks_total, running=s.running, preemptions=s.preemptions,
                          prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits)
        return WorkerInfo(worker_id=s.worker_id, pool=parse_pool(self.worker.pool), address=s.address,
                          model_fingerprint=s.model_fingerprint, version=self._version, load=load,
                          draining=s.draining, pid=os.getpid())

    def start(self) -> None:
        """Register now (raises if Redis is unreachable), then beat in the background."""
        self.registry.register(self._info())
        self._last_ok = time.monotonic()
        self._thread.start()

    def set_draining(self) -> None:
        """Tell routing to skip this worker. A worker that lost its lease re-registers as draining."""
        try:
            self.registry.set_draining(self.worker.identity.worker_id, self.worker.pool)
        except WorkerNotRegistered:
            self.registry.register(self._info())

    @property
    def running(self) -> bool:
        """The heartbeat thread runs (it re-registers a lost lease at its next beat)."""
        return self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """Running, and the last beat reached Redis less than one TTL ago."""
        return self.running and time.monotonic() - self._last_ok < self.registry.ttl

    def beat(self) -> None:
        info = self._info()
        try:
            self.registry.heartbeat(info.worker_id, info.pool, info.load)
        except WorkerNotRegistered:
            log.warning("lease of %s was lost; registering again", info.worker_id)
            self.registry.register(info)
        self._last_ok = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except StateError as exc:
                log.warning("heartbeat of %s failed: %s", self.worker.identity.worker_id, exc)
            except Exception:  # a bug must not end the lease silently; the next beat tries again
                log.exception("heartbeat of %s failed", self.worker.identity.worker_id)

    def stop(self) -> None:
        """Stop beating, then deregister. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval_s + 5.0)
        try:
            self.registry.deregister(self.worker.identity.worker_id, self.worker.pool)
        except StateError as exc:  # the lease expires on its own within two TTLs
            log.warning("could not deregister %s: %s", self.worker.identity.worker_id, exc)
