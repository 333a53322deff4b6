"""Which code a process runs (``code_version``): the digest follows the source files' content and names, not
their folder or caches; ``epd status`` flags a worker whose code differs from the API's; ``epd --version``."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.admin_client import format_status
from controlplane.code_version import code_version, source_digest

pytestmark = [pytest.mark.unit]


def _tree(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "a.py").write_text("A = 1\n")
    (root / "pkg" / "sub" / "b.py").write_text("B = 2\n")
    return root / "pkg"


def test_the_digest_follows_content_and_names_not_the_folder_or_caches(tmp_path):
    one = _tree(tmp_path / "one")
    two = _tree(tmp_path / "two")
    base = source_digest([("pkg", one)])
    assert source_digest([("pkg", two)]) == base  # another folder, another host: the same code
    (two / "__pycache__").mkdir()
    (two / "__pycache__" / "a.cpython-311.py").write_text("junk")
    (two / "notes.txt").write_text("not code")
    assert source_digest([("pkg", two)]) == base
    (two / "sub" / "b.py").write_text("B = 3\n")  # an edit
    assert source_digest([("pkg", two)]) != base
    (two / "sub" / "b.py").write_text("B = 2\n")
    (two / "sub" / "b.py").rename(two / "sub" / "c.py")  # a rename
    assert source_digest([("pkg", two)]) != base
    shutil.rmtree(two / "sub")
    (two / "a.py").write_text("A = 1\n")
    assert source_digest([("pkg", two)]) != base  # a file gone
    assert source_digest([("other", one)]) != base  # the package's name counts


def test_editor_files_and_dangling_links_neither_count_nor_stop_it(tmp_path):
    one = _tree(tmp_path / "one")
    base = source_digest([("pkg", one)])
    (one / ".#a.py").symlink_to(tmp_path / "nowhere")  # Emacs's lock file beside a file being edited
    (one / "sub" / ".hidden.py").write_text("X = 1\n")
    (one / "gone.py").symlink_to(tmp_path / "nowhere.py")
    assert source_digest([("pkg", one)]) == base


def test_the_code_version_is_the_release_and_a_digest_of_this_tree():
    version = code_version()
    assert re.fullmatch(r"[0-9][0-9a-z.]*\+[0-9a-f]{12}", version), version
    # a fresh process on the same files says the same (what lets the API and its replicas agree)
    out = subprocess.run([sys.executable, "-m", "controlplane.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == f"epd {version}\n", (out.stdout, out.stderr)


def _status(api: str | None, versions: list[str | None]) -> dict:
    workers = [{"worker_id": f"decode-{i}", "address": f"127.0.0.1:{5000 + i}", "draining": False, "running": 0,
                "queued_tokens": 0, "free_kv_blocks": 4, "total_kv_blocks": 4, "pid": 100 + i,
                **({} if v is None else {"version": v})} for i, v in enumerate(versions)]
    data: dict = {"pools": [{"pool": "decode", "target": len(workers), "ready": len(workers), "workers": workers}]}
    if api is not None:
        data["version"] = api
    return data


def test_status_flags_only_the_workers_whose_code_differs_from_the_apis():
    same = format_status(_status("0.1.0+aaaaaaaaaaaa", ["0.1.0+aaaaaaaaaaaa"] * 2))
    assert "code=" not in same and "code:" not in same, same
    mixed = format_status(_status("0.1.0+aaaaaaaaaaaa", ["0.1.0+aaaaaaaaaaaa", "0.1.0+bbbbbbbbbbbb", None]))
    lines = mixed.splitlines()
    assert [ln for ln in lines if "decode-" in ln and "code=" in ln] == [
        next(ln for ln in lines if "decode-1" in ln), next(ln for ln in lines if "decode-2" in ln)], mixed
    assert "code=0.1.0+bbbbbbbbbbbb" in mixed and "code=unknown" in mixed  # a worker that does not say
    assert lines[-1].startswith("code: 2 worker(s) run other code than the API (0.1.0+aaaaaaaaaaaa)"), mixed
    # an API from before versions were reported: nothing to compare against, nothing flagged
    old_api = format_status(_status(None, ["0.1.0+bbbbbbbbbbbb"]))
    assert "code=" not in old_api and "code:" not in old_api, old_api
