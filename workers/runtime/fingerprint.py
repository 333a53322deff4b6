"""Fingerprints of a model's weights: two workers may exchange KV caches or embeddings only when the
producing and consuming halves agree on them."""

from __future__ import annotations

import json
from typing import Any

import torch
import xxhash
from torch import nn


def module_fingerprint(module: nn.Module, label: str, header: dict[str, Any]) -> str:
    """``label-<hex>`` over ``header`` (config fields) and every parameter's name and bytes (xxh3-128, a
    non-cryptographic hash chosen for speed: it reads every weight once). Cached on the module."""
    cached = getattr(module, "_epd_fingerprint", None)
    if cached is None:
        h = xxhash.xxh3_128()
        h.update(json.dumps(header, sort_keys=True, default=str).encode())
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            h.update(name.encode())
            h.update(p.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().data)
        cached = f"{label}-{h.hexdigest()[:24]}"
        module._epd_fingerprint = cached  # type: ignore[assignment]  # Module.__setattr__ is typed for tensors only
    return cached
