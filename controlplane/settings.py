"""The one settings model for everything epd runs.

Sources, lowest to highest precedence: defaults < YAML file (``--config``) < ``EPD_*`` environment
variables < CLI flags. Nested fields use ``__`` in variables: ``EPD_DECODE__REPLICAS=2``,
``EPD_TRANSFER__CODEC_POLICY=int8``, ``EPD_API__PORT=9000``. Unknown keys are refused (a typo never
silently does nothing), in the YAML file and among the ``EPD_*`` variables alike (except the few in
``ENV_OUTSIDE_SETTINGS``); an empty variable counts as unset. Cross-field rules are checked once, here.
``Settings.model_json_schema()`` is the schema that helm's values.schema.json is built from.
"""

from __future__ import annotations

import contextvars
import json
import os
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource
from pydantic_settings import SettingsError as _SourceError

from controlplane.scheduler.policies import available_policies
from controlplane.settings_input import SettingsError, check_environment, check_yaml, describe, describe_env_error
from kvtransfer.policy import PolicyError, parse_policy

if TYPE_CHECKING:  # torch and the engine: imported where a device or config is built, not with the settings
    import torch

    from workers.runtime.engine import EngineConfig
    from workers.runtime.kv_cache import CacheDType

MiB = 2**20
GiB = 2**30
LOSSLESS = "lossless"  # transfer.codec_policy: the exact codec for the cache's dtype (Settings.wire_codec_policy)
PoolName = Literal["encode", "prefill", "decode"]
POOLS: tuple[PoolName, ...] = ("encode", "prefill", "decode")

# EPD_* variables read on purpose outside this model, each by the code named here. Every other EPD_*
# variable must name a setting, or ``Settings.load`` refuses it (tests/unit/test_settings.py greps the
# repository for EPD_* reads and fails when one is missing from this list).
ENV_OUTSIDE_SETTINGS: dict[str, str] = {
    "EPD_TEST_IMAGE": "1 runs the container-image test (tests/e2e/test_image.py; make test-image)",
    "EPD_CACHE_DIR": "where the demo model is cached (workers/runtime/default_model.py)",
    "EPD_STATE_DIR": "where a local serve keeps its admin token (controlplane/admin_client.py)",
    "EPD_KERNEL_CACHE": "where the native KV codec kernels are compiled to (kvtransfer/codecs/native.py)",
    "EPD_NATIVE_KERNELS": "0 turns the native KV codec kernels off (kvtransfer/codecs/native.py)",
    "EPD_CHART_REDIS_PASSWORD": "helm: the chart's Redis password, spelled into EPD_REDIS__URL by the kubelet",
    "EPD_DEMO_PROMPT": "make demo: the prompt, passed through the environment untouched",
    "EPD_DEMO_MAX_TOKENS": "make demo: the token count, passed through the environment untouched",
    "EPD_KV_TEST_TOKEN": "tests: the transfer token handed to a sender subprocess (tests/integration)",
}
DEVICE_TYPES = ("cpu", "cuda", "mps")
# The control plane's own secrets in the environment: the API's tokens and keys, and the transfer token and
# Redis URL (replicas get those two as actor arguments). Matched as pydantic-settings reads names: case aside.
_SECRET_ENV = ("EPD_API", "EPD_TRANSFER", "EPD_TRANSFER__TOKEN", "EPD_REDIS", "EPD_REDIS__URL",
               "EPD_CHART_REDIS_PASSWORD")


def secret_env_vars(names: Iterable[str]) -> list[str]:
    """Those of ``names`` that may carry a control-plane secret: ``EPD_API`` and every ``EPD_API__*`` (the admin
    and ops tokens, the API keys), the transfer token, the Redis URL (each also as its section's JSON:
    ``EPD_TRANSFER``, ``EPD_REDIS``) and the chart's Redis password."""
    return [n for n in names if n.upper() in _SECRET_ENV or n.upper().startswith("EPD_API__")]

_yaml_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("epd_yaml_file", default=None)


def parse_device(value: str) -> torch.device:
    """``value`` as a ``torch.device`` of a type the engine runs on; ``ValueError`` naming the choices.
    Only the spelling is checked: the device exists where the workers run, not necessarily here."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise ValueError(f"{value!r} is not a device epd runs on: use cpu, cuda, cuda:N or mps")
    return device


def mask_url(url: str) -> str:
    """``url`` with its password (in the authority or a ``password=`` query parameter) shown as ``***``;
    ``***`` alone for what is not a URL at all."""
    from controlplane.state.client import redact

    try:
        return redact(url)
    except ValueError:  # not a URL at all: nothing recognisable to keep
        return "***"


def _numeric(annotation: Any) -> bool:
    """Whether a field of this type holds a number (int or float, optional or not) and never a bool."""
    args = {annotation, *typing.get_args(annotation)}
    return bool(args & {int, float}) and bool not in args


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)  # a NaN deadline never passes

    @model_validator(mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, data: Any) -> Any:
        """pydantic reads true as 1 and false as 0 for a number; in a settings file that is a slip (``replicas:
        true``), refused by name. Lists of numbers (``cpu_affinity``) are checked item by item."""
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            value = data.get(name)
            annotation = field.annotation
            if typing.get_origin(annotation) is list:
                (item,) = typing.get_args(annotation) or (Any,)
                if isinstance(value, list) and _numeric(item) and any(isinstance(v, bool) for v in value):
                    raise ValueError(f"{name} takes a list of numbers, not {json.dumps(value, default=str)}")
            elif isinstance(value, bool) and _numeric(annotation):
                raise ValueError(f"{name} takes a number, not {json.dumps(value)}")
        return data


class EngineSettings(_Model):
    """One pool's torch engine."""

    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weights and compute (bfloat16 on GPUs)")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1, ...")
    threads: int | None = Field(None, ge=1, description="torch CPU threads per worker (default: torch's choice)")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block (a power of two)")
    kv_cache_bytes: int | None = Field(
        None, ge=MiB, description="the KV pool's memory budget in bytes (default: 256 MiB on CPU; on CUDA, sized "
                                  "from free memory by gpu_memory_utilization)")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="CUDA: share of the device's memory the engine may use, weights and KV "
                                         "pool together, when kv_cache_bytes is not given (as vLLM's)")
    cuda_graphs: bool = Field(True, description="CUDA: replay decode steps as CUDA graphs, one per batch bucket")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8"] = Field(
        "auto", description="what the KV cache stores (auto: the engine's dtype; int8/fp8: quantised, with a scale "
                            "per token and head)")
    max_num_seqs: int = Field(64, ge=1, description="sequences decoded together at most")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens computed per engine step at most")
    prefill_chunk_size: int = Field(512, ge=1, description="prompt tokens of one sequence per step at most")
    max_model_len: int | None = Field(None, ge=2, description="context limit (default: the model's)")
    decode_headroom_tokens: int = Field(
        256, ge=0, description="decode: a request's KV is taken in only while every sequence here (and it) can "
                               "still grow this many tokens (fewer when its max_tokens is nearer); else the request "
                               "waits or goes to another replica, instead of preempting a running sequence, which "
                               "would go silent while it recomputes its whole context")
    warmup: bool = Field(True, description="a worker runs its largest prefill and decode steps once before it "
                                           "serves, so its memory peaks at start-up, not later under load")
    prefix_caching: bool = Field(
        True, description="reuse the KV of a prompt's leading full blocks computed for an earlier request (a "
                          "shared system prompt, an earlier turn), as vLLM's and SGLang's prefix caches do; cached "
                          "blocks stay in the pool until it needs the room")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        parse_device(v)
        return v

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v

    @model_validator(mode="after")
    def _budget(self) -> EngineSettings:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}) so every running sequence can decode each step")
        return self

    def _kv_cache_bytes(self) -> int | None:
        """The budget given, or the CPU default; None on CUDA means: size the pool from free memory."""
        if self.kv_cache_bytes is not None or parse_device(self.device).type == "cuda":
            return self.kv_cache_bytes
        return 256 * MiB

    def engine_config(self, kv_layer_dtypes: tuple[CacheDType, ...] | None = None) -> EngineConfig:
        from workers.runtime.engine import EngineConfig

        return EngineConfig(dtype=self.dtype, device=self.device, block_size=self.block_size,
                            kv_cache_bytes=self._kv_cache_bytes(), kv_cache_dtype=self.kv_cache_dtype,
                            gpu_memory_utilization=self.gpu_memory_utilization, cuda_graphs=self.cuda_graphs,
                            kv_layer_dtypes=kv_layer_dtypes, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            prefill_chunk_size=self.prefill_chunk_size, max_model_len=self.max_model_len,
                            warmup=self.warmup, decode_headroom_tokens=self.decode_headroom_tokens,
                            prefix_caching=self.prefix_caching)


class PoolSettings(_Model):
    replicas: int = Field(1, ge=0, le=1000, description="replicas the pool starts with (replicas_file overrides it); "
                                                        "epd scale changes the target while serving")
    num_cpus: float = Field(0.25, ge=0,
                            description="Ray CPUs reserved per replica (0 = none); 0.25 lets 8 replicas share 2 cores")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per replica")
    gpu_visibility: Literal["host", "reserved"] = Field(
        "host", description="with num_gpus and a cuda device: 'host' shows each replica every GPU of its node and "
                            "runs it on the ones Ray reserved (as vLLM does), so replicas on different GPUs of one "
                            "host can push KV by CUDA IPC; 'reserved' is Ray's default (CUDA_VISIBLE_DEVICES narrowed "
                            "to the reserved GPUs; cuda_ipc then works only between replicas sharing a GPU)")
    cpu_affinity: list[int] = Field(default_factory=list, description="pin replica i to core cpu_affinity[i % n] "
                                                                     "(Linux; empty = no pinning)")
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per replica, e.g. {'epd-decode': 1} to place "
                                          "the pool on its own KubeRay worker group")
    malloc_arena_max: int | None = Field(
        2, ge=1, description="glibc malloc arenas in each replica's process (MALLOC_ARENA_MAX; unset = glibc's "
                             "8 per core): with few arenas the start-up warm-up's memory serves every thread")
    trim_memory_quiet_s: float | None = Field(
        30.0, gt=0, description="a replica that has been quiet this many seconds after work (under 2% of a "
                                "core) gives its free heap memory back to the kernel (glibc malloc_trim), "
                                "once; null = never: it keeps a burst's peak resident")
    embedding_cache_bytes: int = Field(
        GiB, ge=0, description="encode pool: host memory per replica for the image embeddings it keeps, an LRU "
                               "keyed by the image's SHA-256 (one LLaVA-1.5 image is 9 MiB; 0 = none); other "
                               "pools ignore it")

    @field_validator("cpu_affinity")
    @classmethod
    def _cores(cls, v: list[int]) -> list[int]:
        if any(c < 0 for c in v):
            raise ValueError(f"cpu_affinity lists core numbers >= 0, got {v}")
        return v

    @field_validator("ray_resources")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, n in v.items() if n < 0 or not k]
        if bad:
            raise ValueError(f"ray_resources need a name and an amount >= 0; bad: {bad}")
        return v
    engine: EngineSettings = EngineSettings()

    @model_validator(mode="after")
    def _visible_gpu(self) -> PoolSettings:
        device = parse_device(self.engine.device)
        reserved = max(1, int(self.num_gpus))  # the GPUs Ray reserves for a replica that asks num_gpus
        if device.type == "cuda" and self.num_gpus > 0 and (device.index or 0) >= reserved:
            choice = "cuda" if reserved == 1 else f"cuda, or cuda:0 to cuda:{reserved - 1}"
            raise ValueError(f"engine.device {self.engine.device} with num_gpus {self.num_gpus}: under Ray, cuda:k is "
                             f"the k-th GPU Ray reserves for the replica, numbered from 0; use {choice}")
        return self

    @property
    def shares_gpu(self) -> bool:
        """Whether other replicas may run on this replica's GPU: it reserves a fraction of one, or none while
        its engine is on CUDA (Ray then leaves every replica the same GPUs). The pool manager starts such
        replicas one after another."""
        return 0 < self.num_gpus < 1 or (self.num_gpus == 0 and parse_device(self.engine.device).type == "cuda")

    @property
    def sees_host_gpus(self) -> bool:
        """Whether a replica sees every GPU of its node and maps its engine device onto the GPUs Ray reserved
        for it (``controlplane.ray_env.reserved_cuda_device``), rather than Ray narrowing CUDA_VISIBLE_DEVICES."""
        return (self.gpu_visibility == "host" and self.num_gpus > 0
                and parse_device(self.engine.device).type == "cuda")

    def process_env(self) -> dict[str, str]:
        """Environment variables a replica's process starts with (they must be set before it starts:
        glibc reads MALLOC_ARENA_MAX once, at its first allocation; Ray reads the GPU switch as the actor
        process starts)."""
        env = {} if self.malloc_arena_max is None else {"MALLOC_ARENA_MAX": str(self.malloc_arena_max)}
        if self.sees_host_gpus:
            from controlplane.ray_env import NOSET_CUDA_VAR
            env[NOSET_CUDA_VAR] = "1"
        return env


class TransferSettings(_Model):
    """The KV and embedding transfer between pools."""

    codec_policy: str = Field(
        LOSSLESS, description="codec per layer. 'lossless' (the default): exact for the KV cache's dtype (bf16 for "
                              "a bfloat16 cache, fp32 for a float32 one). Quantised wires are opt-in: 'int8', 'fp8', "
                              "'int4', mixed 'int8,0=bf16,-1=bf16', calibrated 'auto' / 'auto:0.05'")
    decode_store: Literal["dequantize", "native"] = Field(
        "dequantize", description="native keeps int8/fp8 layers quantised in the decode cache")
    transport: Literal["auto", "grpc", "shm", "tcp", "cuda_ipc"] = Field(
        "auto", description="auto: CUDA IPC when both caches are on GPUs of one host, else shared memory on one "
                            "host, else gRPC bytes; tcp: each push over a bulk TCP connection opened through gRPC "
                            "(fastest across hosts; TLS when mTLS is configured); cuda_ipc: device to device on "
                            "one host (both engines on cuda)")
    token: SecretStr | None = Field(None, description="shared bearer token for KV/embedding RPCs "
                                                      "(generated for a local serve when unset)")
    tls_ca: Path | None = Field(None, description="mTLS for KV/embedding RPCs: the CA that signs every worker's "
                                                  "certificate (PEM); set with tls_cert and tls_key")
    tls_cert: Path | None = Field(None, description="mTLS: this worker's certificate (PEM)")
    tls_key: Path | None = Field(None, description="mTLS: this worker's private key (PEM)")
    timeout_s: float = Field(600.0, gt=0, description="the longest one KV push may take, seconds, from the start of "
                                                      "its prefill (it streams while the prompt computes, so a "
                                                      "queued or long prefill counts); a request's own deadline "
                                                      "may end it sooner")
    stream_budget_bytes: int = Field(64 * MiB, ge=MiB, description="queued bytes per stream at most")
    sender_budget_bytes: int = Field(512 * MiB, ge=MiB, description="queued bytes per prefill worker at most")
    max_streams: int = Field(64, ge=1, le=4096, description="concurrent inbound streams per worker; also the "
                                                            "control plane's cap on its calls in flight to one worker")

    @field_validator("codec_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v.strip() == LOSSLESS:
            return LOSSLESS
        try:
            parse_policy(v)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("token")
    @classmethod
    def _token_length(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError("the transfer token must be at least 16 characters")
        return v

    @model_validator(mode="after")
    def _tls_all_or_none(self) -> TransferSettings:
        tls = (self.tls_ca, self.tls_cert, self.tls_key)
        if any(tls) and not all(tls):
            raise ValueError("mTLS needs all three of tls_ca, tls_cert and tls_key")
        return self


class SchedulerSettings(_Model):
    routing_policy: str = Field(
        "prefix_affinity", description="how replicas are picked: prefix_affinity (where the prompt's prefix is "
                                       "likely cached, unless the pool is out of balance), least_loaded, round_robin")
    queue_size: int = Field(256, ge=1, description="requests waiting for a route at most (each waits while it is "
                                                   "routed, and longer while no decode has room); beyond, 429")
    queue_timeout_s: float = Field(30.0, gt=0, description="longest wait in that queue before 429")
    fcfs_after_s: float = Field(1.0, ge=0, description="a request that has waited this long for decode room "
                                                       "goes first: requests admitted after it leave the "
                                                       "replicas that refused it alone until it is placed, so "
                                                       "a long prompt is not overtaken for good by shorter "
                                                       "ones (0: strictly first come, first served)")
    request_timeout_s: float = Field(600.0, gt=0, description="end-to-end deadline of one request")
    migration_limit: int = Field(3, ge=0, description="times one request may move to another worker after "
                                                       "its worker died, hung or stalled it; beyond, a "
                                                       "retriable 503")
    token_idle_timeout_s: float = Field(5.0, gt=0, description="a streaming worker that sends nothing for this "
                                                                "long is taken as hung and its request moves (a "
                                                                "worker whose engine steps sends a keepalive every "
                                                                "third of it)")
    max_stall_s: float = Field(60.0, gt=0, description="a streaming worker that sends only keepalives this long "
                                                        "(its request waits there for KV blocks, preempted) has "
                                                        "the request moved to another decode replica, if one "
                                                        "could take it (else it waits); the worker is not marked "
                                                        "suspect. At least token_idle_timeout_s")
    first_token_timeout_s: float = Field(60.0, gt=0, description="the same bound before a request's first token "
                                                                  "(it covers queueing and prefill)")
    keepalive_s: float = Field(2.0, gt=0, description="HTTP/2 keepalive ping interval on worker channels; a "
                                                       "worker that misses one for as long again is lost")
    breaker_failures: int = Field(3, ge=1, description="consecutive failed calls that open a worker's circuit "
                                                        "breaker (no routing to it)")
    breaker_open_s: float = Field(5.0, gt=0, description="how long an open breaker waits before one half-open "
                                                          "probe request may try the worker again")

    @field_validator("routing_policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        """A typo fails when the settings load, not after ``epd serve`` has started the pools."""
        if v not in available_policies():
            raise ValueError(f"unknown routing policy {v!r}; known: {', '.join(available_policies())}")
        return v

    @model_validator(mode="after")
    def _stall_past_idle(self) -> SchedulerSettings:
        """A keepalive comes every third of token_idle_timeout_s: a shorter stall bound would move a request
        at its first pause."""
        if self.max_stall_s < self.token_idle_timeout_s:
            raise ValueError(f"max_stall_s ({self.max_stall_s:g}) must be at least token_idle_timeout_s "
                             f"({self.token_idle_timeout_s:g})")
        return self


class ApiSettings(_Model):
    host: str = Field("127.0.0.1", description="address the HTTP API listens on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=1, le=65535, description="port the HTTP API listens on")
    keep_alive_s: int = Field(30, ge=1, le=3600, description="an idle kept-alive client connection is closed after "
                                                             "this long; keep it above your clients' pool expiry "
                                                             "(httpx 5 s, aiohttp 15 s), or a reused connection "
                                                             "can close under a new request")
    sse_keepalive_s: float = Field(15.0, ge=0, le=3600, description="a streamed answer that sends no token this "
                                   "long (a preempted request waiting for KV blocks, a request moving replica) "
                                   "sends an SSE comment line, again after each such silence, so proxies (nginx "
                                   "60 s, AWS ALB 60 s) keep it open; 0 = never")
    served_model_name: str | None = Field(None, description="model id in /v1/models (default: folder name)")
    admin_token: SecretStr | None = Field(None, description="for /admin and epd scale (generated locally if unset)")
    api_keys: list[SecretStr] = Field(default_factory=list, description="accepted bearer keys; empty = open API")
    ops_token: SecretStr | None = Field(None, description="bearer token /metrics and /dashboard ask for (Prometheus: "
                                                          "authorization.credentials); unset = both open")
    cors_allow_origins: list[str] = Field(default_factory=list, description="web origins whose pages may call the "
                                          "API from a browser (CORS), e.g. https://chat.example.com, or * for any; "
                                          "empty = none (no CORS headers)")

    @field_validator("sse_keepalive_s")
    @classmethod
    def _keepalive(cls, v: float) -> float:
        if 0 < v < 0.1:
            raise ValueError(f"{v:g} s would send a comment many times a second: use 0.1 s or more, or 0 for none")
        return v

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        for origin in v:
            parts = urlsplit(origin)
            if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc
                                  or origin != f"{parts.scheme}://{parts.netloc}"):
                raise ValueError(f"{origin!r} is not a web origin: use scheme://host[:port] (no path, no trailing "
                                 f"slash), or * for any")
        return v


class RedisSettings(_Model):
    url: str | None = Field(None, description="redis://host:port/db; unset = epd starts a local redis-server")
    prefix: str = Field("epd", pattern=r"^[A-Za-z0-9_.-]+$", description="prefix of every key")
    heartbeat_ttl_s: float = Field(5.0, gt=0, description="a worker's lease; a silent worker leaves "
                                                             "routing within one TTL (its Redis key expires after two)")
    command_budget_s: float = Field(0.25, gt=0, description="on the request path, the time one Redis command may "
                                                             "take (one try); past it routing uses its last good "
                                                             "snapshot")
    journal_cap: int = Field(10_000, ge=1, description="requests whose journal (state transitions) Redis keeps; "
                                                       "older ones are deleted (a record is a few hundred bytes)")

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        """What redis-py would refuse only once ``epd serve`` connects (the message never shows a password)."""
        if v is None:
            return v
        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"{mask_url(v)!r} is not a Redis URL: use redis://host:port/db, rediss://... (TLS) "
                             f"or unix:///path/to/redis.sock")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError(f"{mask_url(v)!r} names no host: use redis://host:port/db")
        if parts.scheme == "unix" and not parts.path:
            raise ValueError(f"{mask_url(v)!r} names no socket: use unix:///path/to/redis.sock")
        return v


class RaySettings(_Model):
    address: str | None = Field(None, description="join this Ray cluster (one with Ray token auth also needs "
                                "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN in the environment); unset = start a local one")
    namespace: str = Field("epd", description="Ray namespace of the replicas' named actors, where a restarted "
                                               "control plane finds (adopts) them; two control planes on one Ray "
                                               "cluster need two")
    loopback_only: bool = Field(True, description="a local Ray that epd serve starts binds 127.0.0.1 only (GCS, "
                                                  "raylet, agents, workers); false: Ray's default, every interface")
    replica_start_timeout_s: float = Field(180.0, gt=0, description="a new replica must be placed, load its model "
                                                                    "and register within this (raise it where "
                                                                    "nodes or images take long to come up)")


class ObservabilitySettings(_Model):
    """Switches only; where spans go is the standard OTEL_* variables' business (docs/observability.md)."""

    metrics: bool = Field(True, description="record Prometheus metrics (served at /metrics)")
    tracing: bool = Field(True, description="make OpenTelemetry spans and pass W3C trace context to the workers; "
                                            "exported where OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_TRACES_EXPORTER say")


class Settings(BaseSettings):
    # env_ignore_empty: EPD_MODEL= means "unset", not the path "." (nor an empty Redis URL)
    model_config = SettingsConfigDict(env_prefix="EPD_", env_nested_delimiter="__", extra="forbid",
                                      validate_default=True, env_ignore_empty=True)

    model: Path | None = Field(None, description="HF checkpoint folder; unset = the built-in demo model")
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: encode, prefill and decode pools; colocated: decode-pool "
                                     "workers that encode, prefill and decode whole requests (the baseline)")
    encode: PoolSettings = PoolSettings()
    prefill: PoolSettings = PoolSettings()
    decode: PoolSettings = PoolSettings()
    replicas_file: Path | None = Field(
        None, description='JSON file of replica counts, {"decode": 3, ...}: they replace <pool>.replicas at start, '
                          'and a count changed while serving becomes that pool\'s target (as epd scale); the '
                          'helm chart mounts its ConfigMap here')
    transfer: TransferSettings = TransferSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    api: ApiSettings = ApiSettings()
    redis: RedisSettings = RedisSettings()
    ray: RaySettings = RaySettings()
    observability: ObservabilitySettings = ObservabilitySettings()

    @model_validator(mode="after")
    def _cross_field(self) -> Settings:
        if self.replicas_file is not None:
            self._apply_replicas_file(self.replicas_file)
        p, d = self.prefill.engine, self.decode.engine
        if p.block_size != d.block_size:
            raise ValueError(f"prefill.engine.block_size ({p.block_size}) and decode.engine.block_size "
                             f"({d.block_size}) must match: KV blocks move between them as they are")
        if p.max_model_len != d.max_model_len:
            raise ValueError("prefill.engine.max_model_len and decode.engine.max_model_len must match")
        if self.wire_codec_policy().strip().startswith("fp32") and "bfloat16" in (p.dtype, d.dtype):
            raise ValueError("the fp32 codec needs float32 engines; use bf16 for bfloat16 engines")
        if self.mode == "disaggregated":
            if p.dtype != d.dtype:  # the encode pool's, for a vision model: controlplane.serve.fit_pools
                raise ValueError(f"prefill.engine.dtype ({p.dtype}) and decode.engine.dtype ({d.dtype}) must match: a "
                                 f"worker's model fingerprint covers its weights as loaded, and KV caches move only "
                                 f"between equal fingerprints")
            if self.transfer.transport == "cuda_ipc" and {parse_device(p.device).type,
                                                          parse_device(d.device).type} != {"cuda"}:
                raise ValueError(f"transfer.transport cuda_ipc moves KV between GPUs; prefill.engine.device is "
                                 f"{p.device} and decode.engine.device is {d.device} (use auto, or cuda on both)")
        if self.mode == "colocated":
            for name in ("encode", "prefill"):
                pool = self.pool(name)
                if "replicas" in pool.model_fields_set and pool.replicas > 0:
                    raise ValueError(f"colocated mode has no {name} pool (its decode workers encode, prefill and "
                                     f"decode whole requests): leave {name}.replicas unset or 0, and size the "
                                     f"decode pool{self._counts_from()}")
                setattr(self, name, pool.model_copy(update={"replicas": 0}))  # what status and workers see
        if self.mode == "disaggregated" and (self.prefill.replicas == 0) != (self.decode.replicas == 0):
            raise ValueError(f"prefill and decode must both have replicas, or both be scaled to 0"
                             f"{self._counts_from()}")
        return self

    def pool(self, name: PoolName) -> PoolSettings:
        return getattr(self, name)

    def _counts_from(self) -> str:
        return "" if self.replicas_file is None else f" (replicas_file {self.replicas_file} gives the counts)"

    def _apply_replicas_file(self, path: Path) -> None:
        """The counts in ``replicas_file`` replace the pools' ``replicas``, as if each were set here."""
        from controlplane.replicas_file import ReplicasFileError, read_replicas_file

        try:
            counts = read_replicas_file(path)
        except ReplicasFileError as exc:
            raise ValueError(f"replicas_file {path}: {exc}") from None
        for name, count in counts.items():
            setattr(self, name, self.pool(typing.cast(PoolName, name)).model_copy(update={"replicas": count}))

    def wire_codec_policy(self) -> str:
        """``transfer.codec_policy`` as ``kvtransfer.policy.parse_policy`` reads it, with 'lossless' resolved
        from the engines: bf16 when the values that reach the decode cache are bfloat16 anyway (a bfloat16
        prefill cache, or a bfloat16 engine on either side, which the fp32 codec cannot serve), else fp32.
        Prefill and decode replicas resolve it from the same settings, so their codecs always agree."""
        policy = self.transfer.codec_policy
        if policy != LOSSLESS:
            return policy
        p, d = self.prefill.engine, self.decode.engine
        sent = p.dtype if p.kv_cache_dtype in ("auto", "int8", "fp8") else p.kv_cache_dtype  # gathered as p.dtype
        kept = d.dtype if d.kv_cache_dtype == "auto" else d.kv_cache_dtype
        return "bf16" if "bfloat16" in (sent, kept, p.dtype, d.dtype) else "fp32"

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _yaml_file.get()
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    @classmethod
    def load(cls, config: Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
        """Defaults < ``config`` YAML < EPD_* environment < ``overrides`` (CLI flags, nested dicts)."""
        if config is not None:
            check_yaml(config)
        check_environment(os.environ, cls, ENV_OUTSIDE_SETTINGS)
        token = _yaml_file.set(config)
        try:
            return cls(**(overrides or {}))
        except _SourceError as exc:  # an EPD_* value that had to be JSON and is not
            raise SettingsError(describe_env_error(exc, os.environ, cls)) from None
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise SettingsError(describe(exc, cls, os.environ, config, overrides)) from None
        finally:
            _yaml_file.reset(token)

    def redacted(self) -> dict[str, Any]:
        """The effective settings as plain data, secrets shown as '**********' and URL passwords as '***'."""
        data = self.model_dump(mode="json")
        for section, key in (("redis", "url"), ("ray", "address")):
            if data[section][key] is not None:
                data[section][key] = mask_url(data[section][key])
        return data
