"""The replicas file (controlplane/replicas_file.py): read by the settings at start, then watched against a real
redis-server. A changed count becomes the pool's target as `epd scale` sets it; an unchanged count keeps a
target `epd scale` set since; a bad file is refused by name, logged once, and changes no target."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from controlplane.replicas_file import ReplicasFileError, ReplicasFileWatch, check_counts, parse_replicas, read_text
from controlplane.settings import Settings, SettingsError
from controlplane.state import Pool, PoolTargets, StateConnection

from redis_fixture import redis_server, state_conn  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("text,problem", [
    ("", "not JSON"),
    ("decode: 2", "not JSON"),
    ("[2]", 'must be a JSON object such as {"decode": 2}, not list'),
    ('{"gpu": 1}', "unknown pool 'gpu'; pools are encode, prefill and decode"),
    ('{"decode": -1}', "decode: must be an integer from 0 to 1000, not -1"),
    ('{"decode": 1001}', "decode: must be an integer from 0 to 1000, not 1001"),
    ('{"decode": 2.0}', "decode: must be an integer from 0 to 1000, not 2.0"),
    ('{"decode": "2"}', 'decode: must be an integer from 0 to 1000, not "2"'),
    ('{"decode": true}', "decode: must be an integer from 0 to 1000, not true"),
])
def test_a_malformed_file_is_refused_by_name(text: str, problem: str) -> None:
    with pytest.raises(ReplicasFileError) as caught:
        parse_replicas(text)
    assert problem in str(caught.value)


def test_counts_come_back_in_pool_order_and_a_left_out_pool_is_absent() -> None:
    assert list(parse_replicas('{"decode": 3, "encode": 0}').items()) == [("encode", 0), ("decode", 3)]
    assert parse_replicas("{}") == {}


def test_counts_a_deployment_cannot_run_are_refused() -> None:
    check_counts({"encode": 0, "prefill": 2, "decode": 3}, colocated=False, not_needed={"encode": "text-only"})
    with pytest.raises(ReplicasFileError, match="encode: text-only"):
        check_counts({"encode": 1}, colocated=False, not_needed={"encode": "text-only"})
    with pytest.raises(ReplicasFileError, match="prefill: colocated mode has no prefill pool"):
        check_counts({"prefill": 1, "decode": 1}, colocated=True, not_needed={})
    with pytest.raises(ReplicasFileError, match="prefill and decode must both have replicas, or both be 0"):
        check_counts({"prefill": 0, "decode": 2}, colocated=False, not_needed={})
    vision = {"encode": "the model has a vision tower"}
    with pytest.raises(ReplicasFileError, match="encode: 0 replicas, but the model has a vision tower"):
        check_counts({"encode": 0, "prefill": 1, "decode": 1}, colocated=False, not_needed={}, needed=vision)
    check_counts({"encode": 2, "prefill": 1, "decode": 1}, colocated=False, not_needed={}, needed=vision)


def test_an_unreadable_file_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ReplicasFileError, match="cannot read it: No such file or directory"):
        read_text(tmp_path / "missing.json")
    with pytest.raises(ReplicasFileError, match="cannot read it: Is a directory"):
        read_text(tmp_path)
    (tmp_path / "big.json").write_text(" " * (65 * 1024))
    with pytest.raises(ReplicasFileError, match="larger than 64 KiB"):
        read_text(tmp_path / "big.json")
    (tmp_path / "latin1.json").write_bytes(b'{"decode": 1} \xe9')
    with pytest.raises(ReplicasFileError, match="not UTF-8"):
        read_text(tmp_path / "latin1.json")


def test_the_settings_take_the_files_counts_at_start(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    path.write_text('{"prefill": 2, "decode": 3}')
    s = Settings.load(overrides={"replicas_file": str(path), "encode": {"replicas": 1}, "decode": {"replicas": 1}})
    assert (s.encode.replicas, s.prefill.replicas, s.decode.replicas) == (1, 2, 3)  # encode: left out, kept
    assert "replicas" in s.decode.model_fields_set  # counted as set, as serve's model checks need
    path.write_text('{"decode": 0}')
    with pytest.raises(SettingsError, match=rf"prefill and decode must both have replicas, or both be scaled to 0 "
                                            rf"\(replicas_file {path} gives the counts\)"):
        Settings.load(overrides={"replicas_file": str(path)})
    path.write_text('{"prefill": 1}')
    with pytest.raises(SettingsError, match="colocated mode has no prefill pool"):
        Settings.load(overrides={"replicas_file": str(path), "mode": "colocated"})
    path.write_text('{"decode": "3"}')
    with pytest.raises(SettingsError, match=rf"replicas_file {path}: decode: must be an integer"):
        Settings.load(overrides={"replicas_file": str(path)})
    with pytest.raises(SettingsError, match=rf"replicas_file {tmp_path}/none.json: cannot read it"):
        Settings.load(overrides={"replicas_file": str(tmp_path / "none.json")})


def _started(conn: StateConnection, path: Path, counts: dict[str, int]) -> PoolTargets:
    """What `epd serve` does first: the settings read the file, and the pool manager applies their counts."""
    path.write_text(json.dumps(counts))
    settings = Settings.load(overrides={"replicas_file": str(path)})
    targets = PoolTargets(conn)
    for pool in Pool:
        targets.apply_configured(pool, settings.pool(pool.value).replicas)
    return targets


def _clear(targets: PoolTargets) -> None:
    for pool in Pool:
        targets.clear_target(pool)


def test_a_changed_count_becomes_the_target_and_an_unchanged_one_keeps_epd_scale(
        state_conn: StateConnection, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "replicas.json"
    targets = _started(state_conn, path, {"prefill": 1, "decode": 1})
    heard: list[tuple[str, int]] = []
    watch = ReplicasFileWatch(path, targets, colocated=False, on_change=lambda p, n: heard.append((p, n)))
    try:
        assert watch.poll() is True and heard == []  # the counts the start applied change nothing
        assert watch.poll() is False  # same text: not applied again
        path.write_text('{"prefill": 1, "decode": 3}')  # helm upgrade --set settings.decode.replicas=3
        assert watch.poll() is True
        assert heard == [("decode", 3)] and targets.get_target("decode") == 3 and targets.get_target("prefill") == 1
        targets.set_target("decode", 5)  # epd scale decode 5, later: the most recent intent
        path.write_text('{"prefill": 2, "decode": 3}')  # another pool's count changes; decode's does not
        assert watch.poll() is True
        assert targets.get_target("decode") == 5 and targets.get_target("prefill") == 2
        assert heard == [("decode", 3), ("prefill", 2)]

        caplog.set_level(logging.ERROR, logger="controlplane.replicas_file")
        for bad in ('{"decode": ', '{"prefill": 0, "decode": 4}'):
            path.write_text(bad)
            assert watch.poll() is False and watch.poll() is False  # refused, and logged once
        path.unlink()
        assert watch.poll() is False
        errors = [r.getMessage() for r in caplog.records]
        assert len(errors) == 3, errors
        assert errors[0].startswith(f"replicas file {path}: not JSON")
        assert "prefill and decode must both have replicas" in errors[1] and "cannot read it" in errors[2]
        assert all(e.endswith("the pools keep their targets until it is fixed") for e in errors)
        assert (targets.get_target("prefill"), targets.get_target("decode")) == (2, 5)  # nothing changed

        path.write_text('{"prefill": 2, "decode": 1}')  # fixed: applied
        assert watch.poll() is True and targets.get_target("decode") == 1
    finally:
        _clear(targets)


def test_a_pool_the_model_does_not_need_takes_no_replicas_from_the_file(
        state_conn: StateConnection, tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    targets = _started(state_conn, path, {"encode": 0, "prefill": 1, "decode": 1})
    watch = ReplicasFileWatch(path, targets, colocated=False, not_needed={"encode": "not needed: text-only"})
    try:
        path.write_text('{"encode": 2, "prefill": 1, "decode": 2}')
        assert watch.poll() is False
        assert (targets.get_target("encode"), targets.get_target("decode")) == (0, 1)  # all or nothing
    finally:
        _clear(targets)


def test_the_watch_thread_applies_a_change_within_its_interval(state_conn: StateConnection, tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    targets = _started(state_conn, path, {"prefill": 1, "decode": 1})
    watch = ReplicasFileWatch(path, targets, colocated=False, interval_s=0.05).start()
    try:
        path.write_text('{"prefill": 1, "decode": 2}')
        deadline = time.monotonic() + 10
        while targets.get_target("decode") != 2:
            assert time.monotonic() < deadline, "the watch never applied the change"
            time.sleep(0.05)
    finally:
        watch.close()
        _clear(targets)
    path.write_text('{"prefill": 1, "decode": 4}')
    time.sleep(0.3)
    assert targets.get_target("decode") is None  # closed: no thread writes any more


def test_replicas_get_the_counts_without_the_file_or_any_secret(tmp_path: Path) -> None:
    """A replica validates its settings again where it runs, where the file is not mounted (a KubeRay worker
    pod): the settings it gets carry the counts, not the file, and no secret."""
    from controlplane.pools.launch import replica_settings_json

    path = tmp_path / "replicas.json"
    path.write_text('{"prefill": 2, "decode": 3}')
    secrets = {"transfer": {"token": "t" * 32}, "api": {"admin_token": "a" * 32, "api_keys": ["k" * 20],
                                                        "ops_token": "o" * 32}}
    dumped = replica_settings_json(Settings.load(overrides={"replicas_file": str(path), **secrets}))
    path.unlink()
    again = Settings.model_validate_json(dumped)  # as WorkerActor does
    assert again.replicas_file is None and (again.prefill.replicas, again.decode.replicas) == (2, 3)
    assert not [s for s in ("t" * 32, "a" * 32, "k" * 20, "o" * 32) if s in dumped]


def test_a_redis_outage_is_logged_once_and_the_change_waits_for_redis(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from controlplane.state import LocalRedis, connect

    server = LocalRedis().start()
    conn = connect(server.url, "outage")
    path = tmp_path / "replicas.json"
    path.write_text('{"prefill": 1, "decode": 2}')
    watch = ReplicasFileWatch(path, PoolTargets(conn), colocated=False, interval_s=0.05)
    try:
        server.close()  # Redis gone before the first poll: the change cannot be applied
        caplog.set_level(logging.INFO, logger="controlplane.replicas_file")
        watch.start()
        time.sleep(1.5)
        watch.close()
        away = [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
        assert len(away) == 1 and away[0].levelno == logging.WARNING
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        watch.close()
        conn.close()
        server.close()
