"""epd's own log lines on stderr, each naming the process it comes from.

``epd serve`` calls it as ``serve``; each replica as ``<pool> <index>``, whose stderr Ray keeps in the
worker's log file and forwards to the control plane's output (``log_to_driver``), so a replica's warnings
are seen where ``epd serve`` runs. Only epd's loggers are set; libraries keep their own set-up.
"""

from __future__ import annotations

import logging
import sys

EPD_LOGGERS = ("controlplane", "workers", "kvtransfer")


def log_to_stderr(who: str, level: int = logging.INFO) -> None:
    """Lines of ``level`` and up from epd's modules, as ``LEVEL [who] module: message``. Once per process: a
    second call adds no second handler. A process whose logging is set up already (its root logger has a
    handler: an application that embeds epd, a test runner) keeps its own set-up untouched."""
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(levelname)s [{who}] %(name)s: %(message)s"))
    for name in EPD_LOGGERS:
        logger = logging.getLogger(name)
        if any(getattr(h, "epd_lines", False) for h in logger.handlers):
            continue
        handler.epd_lines = True  # type: ignore[attr-defined]  # marks ours
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
