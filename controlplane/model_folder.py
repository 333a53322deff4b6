"""What ``--model`` / ``model`` must name: a local Hugging Face checkpoint folder, checked before anything loads.

epd never downloads weights. A Hub id (``Qwen/Qwen2-0.5B-Instruct``) where no such folder exists gets a
hint that says so and how to fetch the folder; other mistakes name the path and what is wrong with it.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def model_folder_problem(path: Path) -> str | None:
    """None if ``path`` is a folder with a config.json; else one line saying what is wrong."""
    text = str(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        return (f"{text}: not a checkpoint folder (no config.json; a Hugging Face folder holds config.json, weights, "
                "tokenizer)")
    if path.exists():
        return f"{text}: not a checkpoint folder (it is a file)"
    if HUB_ID.fullmatch(text):  # "./org/name" reads the same here: the path parser drops "./"
        return (f"{text}: not a checkpoint folder (it does not exist). epd serves a local checkpoint folder and "
                f"does not download: if it is a Hugging Face Hub id, fetch it first, e.g. "
                f"`hf download {text} --local-dir ./{path.name}`, then pass --model ./{path.name}")
    return f"{text}: not a checkpoint folder (it does not exist)"
