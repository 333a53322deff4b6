"""Start one worker (encode, prefill or decode) with its gRPC server: what a pool replica runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import grpc

from kvtransfer.auth import TransferSecurity
from kvtransfer.cuda_ipc import IpcPool
from kvtransfer.sender import KVSender, TransportChoice
from workers.decode.kv_sink import KVStore
from workers.runtime.engine import EngineConfig
from workers.runtime.loader import LoadedModel
from workers.service_base import WorkerIdentity, WorkerService, start_worker_server

if TYPE_CHECKING:
    from workers.decode.service import DecodeService

Pool = Literal["encode", "prefill", "decode"]


@dataclass
class RunningWorker:
    pool: Pool
    identity: WorkerIdentity
    server: grpc.Server
    service: WorkerService  # EncodeService | PrefillService | DecodeService | ColocatedService

    @property
    def address(self) -> str:
        return self.identity.address

    def stop(self, grace_s: float = 0.0) -> None:
        self.server.stop(grace_s).wait()
        self.service.close()


def start_worker(pool: Pool, bundle: LoadedModel, security: TransferSecurity, *, config: EngineConfig = EngineConfig(),
                 codecs: tuple[str, ...] | None = None, store: KVStore = "dequantize",
                 transport: TransportChoice = "auto", host: str = "127.0.0.1", port: int = 0,
                 max_streams: int = 64, colocated: bool = False, transfer_timeout_s: float | None = None,
                 stream_budget_bytes: int = 64 * 2**20, sender_budget_bytes: int = 512 * 2**20,
                 embedding_cache_bytes: int | None = None) -> RunningWorker:
    """Start ``pool``'s worker. ``colocated`` (decode pool only): a worker that encodes, prefills and
    decodes whole requests in one engine (workers.colocated) instead of taking KV pushes. A prefill worker's
    pushes take at most ``transfer_timeout_s`` and queue at most the two budgets' bytes (``KVSender``). An
    encode worker keeps at most ``embedding_cache_bytes`` of embeddings (None: ``EncodeService``'s default)."""
    identity = WorkerIdentity(pool)
    decode: DecodeService | None = None  # a KV-receiving decode worker (not a colocated one)
    ipc: IpcPool | None = None  # its CUDA IPC segments, on a GPU
    codecs = codecs or ("bf16",) * bundle.config.num_layers
    if colocated:
        from workers.colocated.service import ColocatedService
        if pool != "decode":
            raise ValueError(f"colocated workers belong to the decode pool, not {pool!r}")
        service: WorkerService = ColocatedService(bundle, config, identity)
    elif pool == "encode":
        from workers.encode.service import EncodeService
        if bundle.vision is None:
            raise ValueError(f"an encode worker needs a model with a vision tower (a LLaVA checkpoint or a "
                             f"vision/ folder); {bundle.path} is text-only and needs no encode pool")
        service = (EncodeService(bundle.vision, security, identity) if embedding_cache_bytes is None
                   else EncodeService(bundle.vision, security, identity, cache_bytes=embedding_cache_bytes))
    elif pool == "prefill":
        from workers.prefill.service import PrefillService
        sender = KVSender(security, transport=transport, device=bundle.model.device, max_timeout_s=transfer_timeout_s,
                          stream_budget_bytes=stream_budget_bytes, sender_budget_bytes=sender_budget_bytes)
        service = PrefillService(bundle, config, codecs, sender, identity)
    elif pool == "decode":
        from workers.decode.service import DecodeService
        device = bundle.model.device
        if device.type == "cuda" and transport in ("auto", "cuda_ipc"):  # same-host GPU pushes, device to device
            # allocated before the engine sizes its KV pool from free memory, which then counts them
            ipc = IpcPool(device)
        service = decode = DecodeService(bundle, config, codecs, store, identity, max_streams=max_streams)
    else:
        raise ValueError(f"unknown pool {pool!r}; one of encode, prefill, decode")
    register, generic = service.handlers()
    server, bound = start_worker_server(register, generic, f"{host}:{port}", security, max_streams, identity)
    identity.address = f"{host}:{bound}"
    if decode is not None:
        # the bulk TCP transport's listener, on the gRPC server's host; TLS with the same certificates under mTLS
        decode.receiver.enable_bulk(host, ssl_context=security.ssl_context(server_side=True))
        if ipc is not None:
            decode.receiver.enable_cuda_ipc(ipc)
    return RunningWorker(pool, identity, server, service)
