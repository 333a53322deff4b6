"""The W3C ``Server-Timing`` header the API puts on an answer one engine computed whole
(``engine;dur=<ms>``), and its reader (``epd bench controlplane`` subtracts it per request)."""

from __future__ import annotations

HEADER = "server-timing"


def engine_header(seconds: float) -> str:
    """The header's value for an engine time in seconds."""
    return f"engine;dur={seconds * 1e3:.3f}"


def engine_seconds(server_timing: str) -> float:
    """The ``engine`` metric of a Server-Timing header in seconds (NaN when absent or malformed)."""
    for metric in server_timing.split(","):
        name, _, params = metric.strip().partition(";")
        if name == "engine":
            for param in params.split(";"):
                key, _, value = param.strip().partition("=")
                if key == "dur":
                    try:
                        return float(value) / 1e3
                    except ValueError:
                        break
    return float("nan")
