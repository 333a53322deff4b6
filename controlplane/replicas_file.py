"""The replicas file: each pool's replica count, kept outside the settings so that changing it restarts nothing.

Format: one JSON object, pool name -> replica count, e.g. ``{"encode": 0, "prefill": 1, "decode": 3}``. A
pool the file leaves out keeps ``settings.<pool>.replicas``. The helm chart renders it into a ConfigMap
mounted in the control plane's pod, so ``helm upgrade --set settings.decode.replicas=3`` changes the file and
nothing else the pod sees.

- At start (``Settings`` with ``replicas_file`` set) the file's counts replace the settings' before any
  cross-field rule is checked; a file that cannot be read or parsed refuses the settings, naming the file.
- While serving (``ReplicasFileWatch``), the file is read again every ``interval_s``. When its text changed,
  each count goes through ``PoolTargets.apply_configured``: a count that differs from the one last applied
  becomes the pool's target, as ``epd scale`` would set it (the most recent intent wins; a count that did not
  change keeps a target ``epd scale`` set since). A file that is missing, malformed or asks for what this
  deployment cannot run (a pool it does not need, none of a pool it needs, prefill without decode) is logged
  once, as an error, and changes no target until it is fixed. A Redis outage is logged once, and a change
  waits for Redis.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.state import PoolTargets

log = logging.getLogger(__name__)

POOL_NAMES = ("encode", "prefill", "decode")
MAX_REPLICAS = 1000  # as settings.<pool>.replicas and the admin API allow
MAX_FILE_BYTES = 64 * 1024


class ReplicasFileError(ValueError):
    """The replicas file cannot be read, is not the JSON object it must be, or asks for what cannot run."""


def parse_replicas(text: str) -> dict[str, int]:
    """The counts in a replicas file's ``text``, in pool order; ``ReplicasFileError`` naming the problem."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReplicasFileError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ReplicasFileError(f'must be a JSON object such as {{"decode": 2}}, not {type(data).__name__}')
    unknown = sorted(set(data) - set(POOL_NAMES))
    if unknown:
        raise ReplicasFileError(f"unknown pool {unknown[0]!r}; pools are encode, prefill and decode")
    for pool, count in data.items():
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_REPLICAS:
            raise ReplicasFileError(f"{pool}: must be an integer from 0 to {MAX_REPLICAS}, not {json.dumps(count)}")
    return {pool: data[pool] for pool in POOL_NAMES if pool in data}


def read_text(path: Path) -> str:
    """The file's text; ``ReplicasFileError`` when it cannot be read (missing, a folder, too large, not UTF-8)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ReplicasFileError(f"cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ReplicasFileError(f"larger than {MAX_FILE_BYTES // 1024} KiB; it holds three counts at most")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ReplicasFileError("not UTF-8 text") from None


def read_replicas_file(path: Path) -> dict[str, int]:
    """The counts in the file at ``path``; ``ReplicasFileError`` naming the problem (not the path)."""
    return parse_replicas(read_text(path))


def check_counts(counts: Mapping[str, int], *, colocated: bool, not_needed: Mapping[str, str],
                 needed: Mapping[str, str] | None = None) -> None:
    """Refuse counts this deployment cannot run, with the rules the settings and ``epd serve`` apply at start:
    colocated mode runs the decode pool only; prefill and decode both run or are both 0; a pool the model does
    not need (``not_needed``: pool -> why) takes no replicas; a pool it needs whatever else runs (``needed``:
    pool -> why, a vision model's encode pool) takes at least one."""
    for pool, count in counts.items():
        if count == 0:
            if pool in (needed or {}):
                raise ReplicasFileError(f"{pool}: 0 replicas, but {(needed or {})[pool]}")
            continue
        if colocated and pool != "decode":
            raise ReplicasFileError(f"{pool}: colocated mode has no {pool} pool (its decode workers run whole "
                                    f"requests); leave it out or set it to 0, and size decode")
        if pool in not_needed:
            raise ReplicasFileError(f"{pool}: {not_needed[pool]}")
    if not colocated and "prefill" in counts and "decode" in counts \
            and (counts["prefill"] == 0) != (counts["decode"] == 0):
        raise ReplicasFileError("prefill and decode must both have replicas, or both be 0")


class ReplicasFileWatch:
    """Applies the replicas file's changes to the pools' targets while a deployment serves (module doc).

    The first poll applies the file as it is then; counts the settings already applied at start change no
    target (``apply_configured`` keeps a target whose count is unchanged). ``on_change(pool, target)`` hears
    each target this watch changed; it must not block."""

    def __init__(self, path: Path, targets: PoolTargets, *, colocated: bool,
                 not_needed: Mapping[str, str] | None = None, needed: Mapping[str, str] | None = None,
                 interval_s: float = 2.0, on_change: Callable[[str, int], None] | None = None) -> None:
        self.path = path
        self.interval_s = interval_s
        self._targets = targets
        self._applied: str | None = None  # the text last applied
        self._refused: str | None = None  # the last text refused, so a bad file is logged once
        self._colocated = colocated
        self._not_needed = dict(not_needed or {})
        self._needed = dict(needed or {})
        self._redis_away = False  # logged once per outage
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> bool:
        """Read the file once and apply it if its text changed; whether it was applied. Raises only
        ``StateError`` (Redis away: the change is applied at a later poll)."""
        try:
            text = read_text(self.path)
            if text == self._applied:
                self._refused = None
                return False
            counts = parse_replicas(text)
            check_counts(counts, colocated=self._colocated, not_needed=self._not_needed, needed=self._needed)
        except ReplicasFileError as exc:
            problem = f"replicas file {self.path}: {exc}"
            if problem != self._refused:
                log.error("%s; the pools keep their targets until it is fixed", problem)
                self._refused = problem
            return False
        for pool, count in counts.items():
            before = self._targets.get_target(pool)
            now = self._targets.apply_configured(pool, count)
            if now != before:
                log.info("replicas file %s: %s target %s -> %d", self.path, pool, before, now)
                if self._on_change is not None:
                    self._on_change(pool, now)
        self._applied, self._refused = text, None
        return True

    def start(self) -> ReplicasFileWatch:
        self._thread = threading.Thread(target=self._run, name="replicas-file", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
            self._thread = None

    def _run(self) -> None:
        from controlplane.state import StateError

        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except StateError as exc:
                if not self._redis_away:
                    log.warning("replicas file %s: Redis unavailable; a change is applied once it answers: %s",
                                self.path, exc)
                self._redis_away = True
                continue
            except Exception:  # never let the watch die silently: the next poll tries again
                log.exception("replicas file %s: poll failed", self.path)
            if self._redis_away:
                log.info("replicas file %s: Redis answers again", self.path)
                self._redis_away = False
