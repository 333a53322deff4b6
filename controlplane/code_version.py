"""Which code a process runs: the package's version and a digest of the source files it loads from.

A replica imports whatever is on disk when it starts, so a change made under a running deployment (or a
rolling update with a new image) leaves replicas of two versions serving side by side. Each worker registers
``code_version()`` and the API reports its own, so ``epd status`` can show which replicas differ.

The digest covers every ``.py`` file of the packages that make up a worker and the API (``controlplane``,
``workers``, ``kvtransfer`` and the generated ``epd`` protocol code), by path relative to its package and
content: the same files give the same digest on any host and in any folder; any edit changes it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

PACKAGES = ("controlplane", "workers", "kvtransfer", "epd")
DIGEST_CHARS = 12


def source_digest(roots: Iterable[tuple[str, Path]]) -> str:
    """The hex sha256 over each ``(name, folder)``'s ``.py`` files, in a fixed order. Caches, hidden files
    (an editor's lock file such as ``.#dispatch.py``) and anything that is not a regular file are skipped; a
    file that cannot be read counts as a marker, so the digest is still taken."""
    h = hashlib.sha256()
    for name, root in sorted(roots):
        paths = (p for p in root.rglob("*.py") if not any(part.startswith(".") or part == "__pycache__"
                                                           for part in p.relative_to(root).parts))
        for path in sorted(paths):
            if not path.is_file():  # a dangling link, a folder named *.py
                continue
            h.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            try:
                h.update(path.read_bytes())
            except OSError:
                h.update(b"\0unreadable")
            h.update(b"\0")
    return h.hexdigest()


def _package_roots() -> list[tuple[str, Path]]:
    roots = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or ()) if spec is not None else ():
            roots.append((name, Path(location)))
    return roots


@functools.cache
def code_version() -> str:
    """``<package version>+<digest>`` (``+<digest>`` alone when epd is not installed as a package), computed
    once per process."""
    try:
        release = metadata.version("epd")
    except metadata.PackageNotFoundError:
        release = ""
    try:
        digest = source_digest(_package_roots())[:DIGEST_CHARS]
    except OSError:  # a folder that cannot be listed: it is only for showing, never a reason not to serve
        digest = "unknown"
    return f"{release}+{digest}"
