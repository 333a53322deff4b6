"""Finding a deployment's processes from outside it (Linux ``/proc``): the process listening on a
worker's port, the private redis-server among ``epd serve``'s descendants, resident memory."""

from __future__ import annotations

import os
import re
from pathlib import Path

PROC = Path("/proc")


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(inode)
    return inodes


def _pids() -> list[int]:
    return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]


def listening_pid(port: int) -> int | None:
    """The process that listens on TCP ``port`` (None when none is found or it is not ours to see)."""
    wanted = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not wanted:
        return None
    for pid in _pids():
        try:
            for fd in (PROC / str(pid) / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return pid
        except OSError:
            continue
    return None


def descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for p in _pids():
        try:
            stat = (PROC / str(p) / "stat").read_text()
        except OSError:
            continue
        parents[p] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def private_redis(serve_pid: int) -> tuple[int, int] | None:
    """(pid, port) of the redis-server ``epd serve`` started, or None."""
    for pid in sorted(descendants(serve_pid)):
        args = cmdline(pid)
        if not args or not args[0].strip() or not Path(args[0].split()[0]).name.startswith("redis-server"):
            continue
        if "--port" in args:
            return pid, int(args[args.index("--port") + 1])
        found = re.search(r":(\d+)\b", " ".join(args))  # redis-server retitles itself "redis-server HOST:PORT"
        if found:
            return pid, int(found.group(1))
    return None


def memory_bytes(pid: int) -> tuple[int, int] | None:
    """(resident, resident anonymous) bytes of ``pid``, or None when it is gone or not ours to read.
    Anonymous memory is the heap and the tensors; the rest of RSS is files (libraries, the checkpoint's
    mapped weights) and shared memory (KV segments, which the receiving process maps too)."""
    fields: dict[str, int] = {}
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon"):
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "VmRSS" not in fields:
        return None  # a zombie, or a kernel thread
    return fields["VmRSS"], fields.get("RssAnon", fields["VmRSS"])


def process_name(pid: int) -> str:
    """A short name for a process: ``ray::Name`` or ``redis-server`` as it titles itself, else the program
    and, for Python, its script or ``-m`` module (``python ray/_private/log_monitor.py``, ``gcs_server``)."""
    args = [a for a in cmdline(pid) if a]
    if not args:
        return "?"
    first = args[0].split()[0]
    if first.startswith("ray::") or Path(first).name.startswith("redis-server"):
        return Path(first).name
    prog = Path(first).name
    if not prog.startswith("python"):
        return prog
    rest = [a for a in args[1:] if a != "-u"]
    if len(rest) >= 2 and rest[0] in ("-m", "-c"):
        return f"python -m {rest[1]}" if rest[0] == "-m" else "python -c"
    script = next((a for a in rest if not a.startswith("-")), "")
    parts = Path(script).parts
    return f"python {'/'.join(parts[-3:])}" if parts else prog
