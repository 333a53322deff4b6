"""`epd status`, `epd scale`, `epd drain`: the admin API's client, and where a local serve keeps its
admin token (a file only the user can read, so the CLI finds it without the token being typed)."""

from __future__ import annotations

import json
import os
import secrets
import urllib.error
import urllib.request
from pathlib import Path

from controlplane.settings import Settings


def state_dir() -> Path:
    return Path(os.environ.get("EPD_STATE_DIR") or Path.home() / ".local" / "state" / "epd")


def admin_token_file() -> Path:
    return state_dir() / "admin_token"


def ensure_admin_token(settings: Settings) -> str:
    """The configured admin token, else the local one (generated once, written with mode 0600)."""
    if settings.api.admin_token is not None:
        return settings.api.admin_token.get_secret_value()
    path = admin_token_file()
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def find_admin_token(settings: Settings) -> str:
    if settings.api.admin_token is not None:
        return settings.api.admin_token.get_secret_value()
    path = admin_token_file()
    if not path.exists():
        raise AdminError(f"no admin token: set EPD_API__ADMIN_TOKEN, or run this where `epd serve` wrote {path}")
    return path.read_text().strip()


class AdminError(Exception):
    """The admin API could not be reached, refused the token, or refused the change."""


def call(settings: Settings, method: str, path: str, body: dict | None = None, url: str | None = None) -> dict:
    base = url or f"http://{settings.api.host}:{settings.api.port}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {find_admin_token(settings)}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            err = json.loads(detail)
            detail = (err.get("error") or {}).get("message") or err.get("detail") or detail
        except json.JSONDecodeError:
            pass
        raise AdminError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        raise AdminError(f"cannot reach the epd API at {base} ({exc.reason}); is `epd serve` running?") from None


def format_status(data: dict) -> str:
    lines = [f"{'pool':<9}{'target':>7}{'ready':>7}  workers"]
    for p in data["pools"]:
        target = "-" if p["target"] is None else str(p["target"])
        lines.append(f"{p['pool']:<9}{target:>7}{p['ready']:>7}")
        for w in p["workers"]:
            state = "draining" if w["draining"] else "ready"
            kv = f"kv {w['total_kv_blocks'] - w['free_kv_blocks']}/{w['total_kv_blocks']} blocks" if w[
                "total_kv_blocks"] else ""
            lines.append(f"{'':<16}  {w['worker_id']} {w['address']} {state} running={w['running']} "
                         f"queued_tokens={w['queued_tokens']} {kv}".rstrip())
    return "\n".join(lines)
