"""epd's log lines on stderr (a replica's, which Ray forwards to `epd serve`'s output, and the serve's own),
each naming its process, from INFO up, and only epd's modules; set up twice, each line is still printed once;
a process whose logging is set up already is left alone."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from controlplane.log_lines import EPD_LOGGERS, log_to_stderr

pytestmark = [pytest.mark.unit]

PROCESS = r"""
import logging
import os
from controlplane.log_lines import log_to_stderr
log_to_stderr("prefill 1")
log_to_stderr("prefill 1")
logging.getLogger("workers.quiet_trim").info("gave %d MiB back", 12)
logging.getLogger("kvtransfer.receiver").debug("not shown")
logging.getLogger("controlplane.pools.actor").warning("a warning")
logging.getLogger("some.library").warning("left to the library's own set-up")
"""


def test_lines_name_the_process_from_info_up_once():
    out = subprocess.run([sys.executable, "-c", PROCESS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines == ["INFO [prefill 1] workers.quiet_trim: gave 12 MiB back",
                     "WARNING [prefill 1] controlplane.pools.actor: a warning",
                     "left to the library's own set-up"], out.stderr  # the last: Python's own last resort


def test_a_process_with_logging_set_up_is_left_alone():
    assert logging.getLogger().handlers  # pytest's capture handlers: as an embedding application's would be
    before = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate) for name in EPD_LOGGERS}
    log_to_stderr("serve")
    assert {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate)
            for name in EPD_LOGGERS} == before


def test_replica_lines_are_printed_each_uncoloured_in_a_file_and_a_users_choice_stands(monkeypatch):
    from controlplane.ray_env import replica_lines_environment

    for name in ("RAY_DEDUP_LOGS", "RAY_COLOR_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    replica_lines_environment(stderr_is_terminal=False)
    assert (os.environ["RAY_DEDUP_LOGS"], os.environ["RAY_COLOR_PREFIX"]) == ("0", "0")
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    monkeypatch.setenv("RAY_DEDUP_LOGS", "1")
    replica_lines_environment(stderr_is_terminal=True)
    assert os.environ["RAY_DEDUP_LOGS"] == "1" and "RAY_COLOR_PREFIX" not in os.environ
