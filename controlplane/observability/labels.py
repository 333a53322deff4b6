"""The names every epd: series shares: the prefix, and the ``model_name`` label (the served model's id)."""

from __future__ import annotations

PREFIX = "epd:"


class _ModelName:
    """The served model's id, the ``model_name`` label of every epd: series (one model per control plane)."""

    value = "unknown"


MODEL = _ModelName()
MODEL_LABEL = "model_name"
