"""Argument helpers shared by ``epd``'s own commands and the ``bench`` package's (``epd bench ...``).

Each check raises ``UsageError`` naming the flag, before anything is loaded, so a bad flag costs nothing.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


class UsageError(Exception):
    """A command-line argument that cannot work; the message names the flag."""


def replicas_arg(value: str) -> int:
    """argparse ``type`` for a pool's replica count: an integer from 0 to the limit the admin API takes."""
    from controlplane.replicas_file import MAX_REPLICAS

    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    if not 0 <= count <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"must be from 0 to {MAX_REPLICAS}, got {count}")
    return count


def check_writable(flag: str, path: Path | None, *, folder: bool = False, parents_made: bool = False) -> None:
    """UsageError naming ``flag`` unless ``path`` can be written: a file whose folder exists (or, with
    ``parents_made``, can be made, as its writer makes it), or (``folder``) a folder that exists or can be
    made. Checked before a run, so a typo costs nothing rather than the run."""
    if path is None:
        return
    if folder:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {path}: exists and is not a folder")
    elif path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file's path")
    if folder or parents_made:
        where = next(p for p in (path, *path.absolute().parents) if p.exists())
    else:
        where = path.parent
        if not where.exists():
            raise UsageError(f"{flag} {path}: the folder {where} does not exist")
    if not where.is_dir():
        raise UsageError(f"{flag} {path}: {where} is not a folder")
    if not os.access(where, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {where} is not writable")


def path_arg(value: str) -> Path:
    """argparse ``type`` for a path: refuses an empty one, which ``Path`` would read as the current folder."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return Path(value)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--dtype``, ``--device`` and ``--threads`` of a command that runs the engine here."""
    p.add_argument("--model", type=path_arg, default=None,
                   help="HF checkpoint folder (default: the built-in demo model with random weights)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype (default float32)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N or mps (default: cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads, >= 1 (default: torch's choice)")


def check_engine_args(args: argparse.Namespace) -> None:
    """--device and --threads of a command that runs the engine here: ``UsageError`` before any loading."""
    from controlplane.settings import parse_device
    from workers.runtime.devices import device_problem
    try:
        device = parse_device(args.device)
    except ValueError as exc:
        raise UsageError(f"--device {exc}") from None
    problem = device_problem(device)
    if problem is not None:
        none_here = device_problem(device.type) is not None  # no such device at all, not just that index
        raise UsageError(f"--device {args.device}: {problem}{'; use --device cpu' if none_here else ''}")
    check_threads(args)


def check_threads(args: argparse.Namespace) -> None:
    """``--threads``, when given, must be >= 1."""
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads} (leave it out for torch's choice)")


def int_list(text: str, flag: str) -> list[int]:
    """A comma list of integers >= 1 (``--batches 1,8,16``); ``UsageError`` naming ``flag`` otherwise."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag} takes a comma list of integers, e.g. 1,8,16; got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} values must be >= 1, got {text!r}")
    return values


def check_positive(args: argparse.Namespace, *flags: str) -> None:
    """Each ``--flag`` (an int) must be >= 1."""
    for flag in flags:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")


def model_dir(arg: Path | None) -> Path:
    """``--model``'s folder, or the built-in demo model's (written on first use) when it is not given."""
    from controlplane.model_folder import model_folder_problem
    from workers.runtime.default_model import ensure_default_checkpoint

    if arg is None:
        return ensure_default_checkpoint()
    problem = model_folder_problem(arg)
    if problem is not None:
        raise UsageError(f"--model {problem}")
    return arg
