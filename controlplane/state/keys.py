"""The one place that names Redis keys. Every key the control plane writes is built here.

All keys sit under ``{prefix}:`` (default ``epd``), so one Redis can hold several deployments and a
deployment's state can be listed with ``SCAN MATCH {prefix}:*``. Singular names are entities, plural
names are their indexes.

| key                                   | type   | TTL (seconds)                       | writer                     |
|---------------------------------------|--------|-------------------------------------|----------------------------|
| ``{prefix}:worker:{pool}:{worker_id}``| hash   | 2 x lease TTL, refreshed per beat   | worker (register/heartbeat)|
| ``{prefix}:workers:{pool}``           | zset   | 2 x lease TTL, extended per beat    | worker; pruned by readers  |
|                                       |        | (member worker_id, score lease end) |                            |
| ``{prefix}:pool:{pool}:target``       | string | none (desired state)                | control plane (scale)      |
| ``{prefix}:pool:{pool}:configured``   | string | none (replicas the settings asked)  | pool manager (start),      |
|                                       |        | or the replicas file, last          | replicas file watch        |
| ``{prefix}:journal:{request_id}``     | list   | retention (default 3600), per write | scheduler                  |
| ``{prefix}:journals``                 | zset   | retention, per write; capped length | scheduler                  |
|                                       |        | (member request_id, score last at)  |                            |
| ``{prefix}:counter:{name}``           | string | none (monotonic integer)            | any control-plane process  |
| ``{prefix}:counters``                 | set    | none (names of the counters above)  | any control-plane process  |

``KEY_LAYOUT`` is the same table as data, so tests can check every key Redis holds against it.
Ids (worker ids, request ids, counter names, the prefix) are validated: non-empty, at most 256
characters, no ``:`` and no whitespace, so a key never has to be parsed back into its parts.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

DEFAULT_PREFIX = "epd"
MAX_ID_LENGTH = 256
_FORBIDDEN = re.compile(r"[:\s]")
_GLOB = re.compile(r"[*?\[\]\\]")


class Pool(enum.StrEnum):
    """The three worker pools. The value is the name used in keys, settings and the CLI."""

    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"


class InvalidKeyPart(ValueError):
    """An id, name or prefix that cannot be part of a key (empty, too long, ':' or whitespace)."""


def validate_id(kind: str, value: str) -> str:
    """Return ``value`` if it can be one component of a key; raise ``InvalidKeyPart`` saying why."""
    if not isinstance(value, str):
        raise InvalidKeyPart(f"{kind} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidKeyPart(f"{kind} must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidKeyPart(f"{kind} is {len(value)} characters; at most {MAX_ID_LENGTH} are allowed")
    bad = _FORBIDDEN.search(value)
    if bad:
        raise InvalidKeyPart(f"{kind} {value!r} contains {bad.group()!r}; ':' and whitespace are not allowed")
    return value


def parse_pool(value: Pool | str) -> Pool:
    """``Pool`` from a pool or its name; ``InvalidKeyPart`` names the valid pools otherwise."""
    try:
        return Pool(value)
    except ValueError:
        names = ", ".join(p.value for p in Pool)
        raise InvalidKeyPart(f"unknown pool {value!r}; expected one of: {names}") from None


@dataclass(frozen=True)
class KeySpec:
    """One row of the layout table: the key's template, Redis type, TTL policy and writer."""

    template: str
    redis_type: str
    ttl: str
    writer: str

    def matches(self, prefix: str, key: str) -> bool:
        """Whether ``key`` is an instance of this template under ``prefix``."""
        pattern = re.escape(self.template.replace("{prefix}", prefix))
        pattern = re.sub(r"\\\{[a-z_]+\\\}", r"[^:\\s]+", pattern)
        return re.fullmatch(pattern, key) is not None


KEY_LAYOUT: tuple[KeySpec, ...] = (
    KeySpec("{prefix}:worker:{pool}:{worker_id}", "hash", "2 x lease TTL", "worker"),
    KeySpec("{prefix}:workers:{pool}", "zset", "2 x lease TTL", "worker; readers prune"),
    KeySpec("{prefix}:pool:{pool}:target", "string", "none", "control plane"),
    KeySpec("{prefix}:pool:{pool}:configured", "string", "none", "pool manager; replicas file watch"),
    KeySpec("{prefix}:journal:{request_id}", "list", "retention", "scheduler"),
    KeySpec("{prefix}:journals", "zset", "retention", "scheduler"),
    KeySpec("{prefix}:counter:{name}", "string", "none", "control plane"),
    KeySpec("{prefix}:counters", "set", "none", "control plane"),
)


@dataclass(frozen=True)
class KeySpace:
    """Typed builders for every key under one prefix. Callers never format key strings themselves."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        validate_id("key prefix", self.prefix)
        if _GLOB.search(self.prefix):
            raise InvalidKeyPart(f"key prefix {self.prefix!r} must not contain glob characters *?[]\\")

    @property
    def pattern(self) -> str:
        """``SCAN MATCH`` pattern for every key of this deployment."""
        return f"{self.prefix}:*"

    def owns(self, key: str) -> bool:
        """Whether ``key`` lies under this prefix."""
        return key.startswith(f"{self.prefix}:")

    def spec_of(self, key: str) -> KeySpec | None:
        """The layout row ``key`` belongs to, or None for a key this module never builds."""
        return next((spec for spec in KEY_LAYOUT if spec.matches(self.prefix, key)), None)

    def worker(self, pool: Pool | str, worker_id: str) -> str:
        """Hash of one worker's address, load and lease."""
        return f"{self.prefix}:worker:{parse_pool(pool).value}:{validate_id('worker id', worker_id)}"

    def workers(self, pool: Pool | str) -> str:
        """Sorted set of a pool's worker ids, scored by lease end (seconds, the registry's clock)."""
        return f"{self.prefix}:workers:{parse_pool(pool).value}"

    def pool_target(self, pool: Pool | str) -> str:
        """Desired replica count of a pool (decimal string)."""
        return f"{self.prefix}:pool:{parse_pool(pool).value}:target"

    def pool_configured(self, pool: Pool | str) -> str:
        """The replica count the settings asked for when the pool manager last started (decimal string)."""
        return f"{self.prefix}:pool:{parse_pool(pool).value}:configured"

    def journal(self, request_id: str) -> str:
        """List of one request's state transitions (three elements each: state, at, detail)."""
        return f"{self.journal_prefix()}{validate_id('request id', request_id)}"

    def journal_prefix(self) -> str:
        """What ``journal(request_id)`` puts before the id (the journal's Lua script deletes by id)."""
        return f"{self.prefix}:journal:"

    def journals(self) -> str:
        """Sorted set of recent request ids, scored by their last transition time (seconds)."""
        return f"{self.prefix}:journals"

    def counter(self, name: str) -> str:
        """Integer counter."""
        return f"{self.prefix}:counter:{validate_id('counter name', name)}"

    def counters(self) -> str:
        """Set of counter names, so all counters can be read without a SCAN."""
        return f"{self.prefix}:counters"
