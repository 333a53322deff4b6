"""The HF transformers reference the engine benchmarks measure against (CPU and GPU alike)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch


def load_hf_model(path: Path, dtype: torch.dtype) -> Any:  # transformers is optional and untyped
    """``AutoModelForCausalLM`` from the same checkpoint folder, in eval mode, quiet. Without transformers:
    a one-line message and exit status 2 (the engine's figures need no reference with ``--no-hf``)."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        print("epd bench engine: transformers is not installed (the bench extra: pip install transformers); "
              "use --no-hf", file=sys.stderr)
        raise SystemExit(2) from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
