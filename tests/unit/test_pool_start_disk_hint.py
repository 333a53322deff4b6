"""A replica that dies at start on a nearly full disk: Ray cannot write its logs, so nothing of its own says
why; the pool manager's start error then says how full the disk under Ray's folder is."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from controlplane.pools import launch

pytestmark = pytest.mark.unit
Usage = namedtuple("Usage", "total used free")


def test_a_nearly_full_disk_under_rays_folder_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(64 * 2**20, 63 * 2**20, 2**20))
    assert launch.disk_hint(tmp_path) == (
        f" (the disk under Ray's folder {tmp_path} has 1 MiB free of 64 MiB: a full disk stops new replicas; "
        "free space there, or set TMPDIR)")


def test_room_enough_or_no_private_cluster_adds_nothing(tmp_path: Path) -> None:
    assert launch.disk_hint(tmp_path) == ""  # this machine's temporary folder has room
    assert launch.disk_hint(None) == ""  # an external cluster: its nodes' disks are not ours to read
    assert launch.disk_hint(tmp_path / "gone") == ""
