"""`epd status`, `epd scale`, `epd drain`: the admin API's client, and where a local serve keeps its
admin token (a file only the user can read, so the CLI finds it without the token being typed)."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from controlplane.settings import Settings


def state_dir() -> Path:
    return Path(os.environ.get("EPD_STATE_DIR") or Path.home() / ".local" / "state" / "epd")


def admin_token_file() -> Path:
    return state_dir() / "admin_token"


def private_redis_url_file(api_port: int) -> Path:
    """Where ``epd serve`` on ``api_port`` keeps its private redis-server's URL, password included, while it
    runs (mode 0600): for ``redis-cli -u`` and tools such as ``epd bench chaos``."""
    return state_dir() / f"private-redis.{api_port}.url"


def write_private_file(path: Path, text: str) -> None:
    """``text`` into ``path``, readable by this user only (a stale file from an earlier run is replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def ensure_admin_token(settings: Settings) -> str:
    """The configured admin token, else the local one (generated once, written with mode 0600)."""
    if settings.api.admin_token is not None:
        return settings.api.admin_token.get_secret_value()
    path = admin_token_file()
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(32)
    write_private_file(path, token)
    return token


def find_admin_token(settings: Settings) -> str:
    found = _admin_token_or_none(settings)
    if found is None:
        raise _no_admin_token()
    return found[0]


def _no_admin_token() -> AdminError:
    return AdminError(f"no admin token: set EPD_API__ADMIN_TOKEN, or run this where `epd serve` wrote "
                      f"{admin_token_file()}")


def _admin_token_or_none(settings: Settings) -> tuple[str, str] | None:
    """The admin token and where it came from, in words (for a refusal to name)."""
    if settings.api.admin_token is not None:
        return settings.api.admin_token.get_secret_value(), "api.admin_token (EPD_API__ADMIN_TOKEN or --config)"
    path = admin_token_file()
    try:
        return (path.read_text().strip(), f"the file {path}") if path.exists() else None
    except OSError as exc:
        raise AdminError(f"cannot read the admin token file {path}: {exc.strerror}") from None


class AdminError(Exception):
    """The admin API could not be reached, refused the token, or refused the change (``status``: the HTTP
    status it answered with, when it answered)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def api_url(settings: Settings, url: str | None = None) -> str:
    """The API's base URL: ``url`` (--url) when given, else the settings' host and port."""
    base = (url or f"http://{settings.api.host}:{settings.api.port}").rstrip("/")
    try:
        parts = urlsplit(base)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise AdminError(f"{base!r} is not the URL of an epd API: use http://host:port (or https://)")
    return base


def call(settings: Settings, method: str, path: str, body: dict | None = None, url: str | None = None,
         timeout: float = 10.0) -> dict:
    """One admin request; its JSON reply. ``AdminError`` (naming the URL) for every way it can fail.
    Without an admin token, a read-only probe first tells an API that is down from a missing token."""
    base = api_url(settings, url)
    found = _admin_token_or_none(settings)
    if found is None:
        _request(base, "GET", "/admin/pools", None, None, timeout, probe=True)
        raise _no_admin_token()  # the API answered: the token is what is missing
    token, source = found
    try:
        return _request(base, method, path, body, token, timeout)
    except AdminError as exc:
        if exc.status != 401:
            raise
        raise AdminError(f"{exc}; the token sent came from {source}, and another `epd serve` (another "
                         f"EPD_STATE_DIR) has another one", exc.status) from None


def _request(base: str, method: str, path: str, body: dict | None, token: str | None, timeout: float,
             probe: bool = False) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        if probe:
            return {}  # it answered; what it said needs the token
        detail = exc.read().decode(errors="replace")
        try:
            err = json.loads(detail)
            detail = (err.get("error") or {}).get("message") or err.get("detail") or detail
        except (json.JSONDecodeError, AttributeError):  # not JSON, or JSON that is not epd's error shape
            raise AdminError(f"{method} {base}{path}: HTTP {exc.code}, and the reply is not epd's error shape; is "
                             f"{base} an epd API?") from None
        raise AdminError(f"{method} {base}{path}: HTTP {exc.code}: {detail}", exc.code) from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise AdminError(f"the epd API at {base} did not answer within {timeout:g} s") from None
        raise AdminError(f"cannot reach the epd API at {base} ({exc.reason}); is `epd serve` running?") from None
    except TimeoutError:  # connected, then no reply in time
        raise AdminError(f"the epd API at {base} did not answer within {timeout:g} s") from None
    except (OSError, http.client.HTTPException) as exc:  # reset, closed mid-reply, not HTTP at all
        raise AdminError(f"the epd API at {base} broke off the reply ({type(exc).__name__}: {exc}); "
                         f"is {base} an epd API?") from None
    except ValueError as exc:  # http.client.InvalidURL: characters no request line can carry
        raise AdminError(f"{base!r} is not a usable URL: {exc}") from None
    if probe:
        return {}
    try:
        reply = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        reply = None
    if not isinstance(reply, dict):
        raise AdminError(f"{method} {base}{path}: the reply is not a JSON object; is {base} an epd API?")
    return reply


def serving_degraded(settings: Settings, url: str | None = None, timeout: float = 10.0) -> str | None:
    """Why the API serves in a degraded way now (its /ready's ``degraded``: Redis stalled, suspect workers), or
    None: also when /ready cannot be read, since this only adds to what the admin call reports."""
    base = api_url(settings, url)
    try:
        with urllib.request.urlopen(base + "/ready", timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:  # 503 (not ready) still carries the body
        raw = exc.read()
    except (OSError, http.client.HTTPException):
        return None
    try:
        degraded = json.loads(raw).get("degraded")
    except (json.JSONDecodeError, AttributeError):
        return None
    return degraded if isinstance(degraded, str) and degraded else None


def format_status(data: dict) -> str:
    lines = [f"{'pool':<9}{'target':>7}{'ready':>7}  workers"]
    api_code = data.get("version")  # the code the API runs (an older API does not say)
    other: list[str] = []  # workers that run other code
    for p in data["pools"]:
        target = "-" if p["target"] is None else str(p["target"])
        if p.get("not_needed"):  # e.g. a text-only model's encode pool (an older API never says)
            lines.append(f"{p['pool']:<9}{'-':>7}{'-':>7}  {p['not_needed']}")
            continue
        lines.append(f"{p['pool']:<9}{target:>7}{p['ready']:>7}")
        for w in p["workers"]:
            state = "draining" if w["draining"] else "ready"
            kv = f"kv {w['total_kv_blocks'] - w['free_kv_blocks']}/{w['total_kv_blocks']} blocks" if w[
                "total_kv_blocks"] else ""
            pid = f" pid={w['pid']}" if w.get("pid") else ""  # an older API, or worker, does not say
            code = ""
            if api_code and w.get("version") != api_code:
                other.append(w["worker_id"])
                code = f" code={w.get('version') or 'unknown'}"
            # said once there are some: a worker that preempts needs more KV memory or fewer sequences
            preempted = f" preemptions={w['preemptions']}" if w.get("preemptions") else ""
            # the share of looked-up prompt tokens its prefix cache held, once it looked any up
            queried = w.get("prefix_cache_queries", 0)
            cached = f" prefix_hits={100 * w.get('prefix_cache_hits', 0) / queried:.0f}%" if queried else ""
            lines.append(f"{'':<16}  {w['worker_id']} {w['address']}{pid} {state} running={w['running']} "
                         f"queued_tokens={w['queued_tokens']} {kv}".rstrip() + preempted + cached + code)
        for r in p.get("pending", ()):  # an API from before pending replicas were shown has none
            lines.append(f"{'':<16}  {r['name']} pending {r['waiting_s']:.0f} s: {r['reason']}")
        if p.get("problem"):
            lines.append(f"{'':<16}  {p['problem']}")
    if other:
        lines.append(f"code: {len(other)} worker(s) run other code than the API ({api_code}), shown as code=: "
                     f"they loaded other files when they started (a change on disk since, or another image). "
                     f"Restart the deployment to serve one version.")
    return "\n".join(lines)
