"""Joining a Ray cluster at an address (RayRuntime.start): which failures are tried again and what the one-line
error says. Pure logic: ``ray.init`` is replaced by a stand-in that fails as the Ray client does (the real join,
with and without the chart's token, is in tests/helm/test_chart_ray_token.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from controlplane.pools import ray_runtime
from controlplane.pools.ray_runtime import JOIN_TRIES, RayRuntime
from controlplane.pools.status import PoolError, RayJoinError

ADDRESS = "ray://head.example:10001"
# what the Ray client raises when the head's proxy could not start this client's server process
PROXY_REFUSAL = ConnectionAbortedError(
    "Initialization failure from server:\nTraceback (most recent call last):\n  File \"proxier.py\", line 766\n"
    "RuntimeError: Starting Ray client server failed. See ray_client_server_23004.err for detailed logs.\n")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[BaseException | None]], list[str]]:
    """``script(outcomes)``: ray.init raises each outcome in turn (None: joins); returns the call log."""
    def script(outcomes: list[BaseException | None]) -> list[str]:
        log: list[str] = []
        it = iter(outcomes)

        def init(**kwargs: object) -> None:
            log.append(f"init {kwargs['address']}")
            outcome = next(it)
            if outcome is not None:
                raise outcome

        monkeypatch.setattr(ray_runtime.ray, "init", init)
        monkeypatch.setattr(ray_runtime.ray, "shutdown", lambda: log.append("shutdown"))
        monkeypatch.setattr(ray_runtime.ray, "is_initialized", lambda: False)
        monkeypatch.setattr(ray_runtime, "JOIN_PAUSE_S", 0.0)
        return log
    return script


def test_a_proxy_that_failed_to_start_the_clients_server_is_tried_again(calls, caplog) -> None:
    log = calls([PROXY_REFUSAL, PROXY_REFUSAL, None])
    runtime = RayRuntime(ADDRESS, "epd")
    runtime.start()
    assert runtime.owns_connection
    assert log == [f"init {ADDRESS}", "shutdown", f"init {ADDRESS}", "shutdown", f"init {ADDRESS}"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and "(try 1 of 3)" in warnings[0]
    assert "Starting Ray client server failed" in warnings[0]


def test_past_the_last_try_the_error_is_one_line_naming_the_address_and_the_servers_reason(calls) -> None:
    log = calls([PROXY_REFUSAL] * JOIN_TRIES)
    runtime = RayRuntime(ADDRESS, "epd")
    with pytest.raises(RayJoinError) as err:
        runtime.start()
    assert log.count(f"init {ADDRESS}") == JOIN_TRIES and not runtime.owns_connection
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, PoolError)  # `epd serve` prints it as one line, exit 2
    assert message.startswith(f"cannot join the Ray cluster at {ADDRESS}: Initialization failure from server: "
                              "RuntimeError: Starting Ray client server failed.")
    assert "ray_client_server*.err in the head's Ray log folder" in message  # the port answered: no port advice
    assert "reachable" not in message


@pytest.mark.parametrize("env,here", [
    ({}, "Here: RAY_AUTH_MODE=disabled, no RAY_AUTH_TOKEN"),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/t"}, "Here: RAY_AUTH_MODE=token, with a token"),
])
def test_a_timeout_is_not_tried_again_and_names_this_processs_auth_mode(
        calls, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], here: str) -> None:
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    log = calls([ConnectionError("ray client connection timeout")])
    with pytest.raises(RayJoinError) as err:
        RayRuntime(ADDRESS, "epd").start()
    assert log == [f"init {ADDRESS}"]
    assert str(err.value).startswith(f"cannot join the Ray cluster at {ADDRESS}: ray client connection timeout. "
                                     "Check that its client port is reachable")
    assert str(err.value).endswith(here)
