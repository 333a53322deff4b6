"""Which codec each layer's KV travels in.

A policy is written as a string, the same in settings, the CLI and helm values:

  "int8"                  every layer int8
  "int8,0=bf16,-1=bf16"   int8, except the first and last layers in bf16 (negative = from the end)
  "auto"                  calibrated: the cheapest codec per layer whose error stays under 2%
  "auto:0.05"             the same with a 5% budget

The error of a codec on a layer is the relative RMS error of the decoded keys and values against
the originals, sqrt(sum((x' - x)^2) / sum(x^2)), the larger of keys and values. ``calibrate``
measures it on sample KV and keeps a safety margin (it picks codecs under 80% of the budget) so
that prompts it has not seen stay under the budget too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtransfer.codecs import CodecError, Kind, available_codecs, get_codec

DEFAULT_BUDGET = 0.02
CALIBRATION_MARGIN = 0.8
# cheapest first; fp32 is the lossless last resort for a float32 cache
AUTO_CANDIDATES: tuple[str, ...] = ("int4", "int8", "fp8", "bf16", "fp32")


class PolicyError(ValueError):
    """A policy string that does not parse, or names an unknown codec or layer."""


@dataclass(frozen=True)
class ExplicitPolicy:
    default: str
    overrides: tuple[tuple[int, str], ...] = ()

    def resolve(self, num_layers: int) -> tuple[str, ...]:
        codecs = [self.default] * num_layers
        for layer, codec in self.overrides:
            index = layer if layer >= 0 else num_layers + layer
            if not 0 <= index < num_layers:
                raise PolicyError(f"codec policy names layer {layer}, but the model has {num_layers} layers")
            codecs[index] = codec
        return tuple(codecs)


@dataclass(frozen=True)
class AutoPolicy:
    budget: float = DEFAULT_BUDGET
    candidates: tuple[str, ...] = AUTO_CANDIDATES


def parse_policy(spec: str) -> ExplicitPolicy | AutoPolicy:
    spec = spec.strip()
    known = available_codecs()
    if spec == "auto" or spec.startswith("auto:"):
        budget = DEFAULT_BUDGET
        if spec.startswith("auto:"):
            try:
                budget = float(spec[5:])
            except ValueError:
                raise PolicyError(f"codec policy {spec!r}: the auto budget must be a number, e.g. auto:0.02") from None
            if not 0 < budget < 1:
                raise PolicyError(f"codec policy {spec!r}: the auto budget must be in (0, 1)")
        return AutoPolicy(budget)
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or "=" in parts[0]:
        raise PolicyError(f"codec policy {spec!r} must start with a default codec, e.g. 'int8,0=bf16'")
    default, overrides = parts[0], []
    for part in parts[1:]:
        layer, sep, codec = part.partition("=")
        try:
            index = int(layer)
        except ValueError:
            raise PolicyError(f"codec policy {spec!r}: {part!r} is not LAYER=CODEC") from None
        if not sep:
            raise PolicyError(f"codec policy {spec!r}: {part!r} is not LAYER=CODEC")
        overrides.append((index, codec.strip()))
    for codec in [default] + [c for _, c in overrides]:
        if codec not in known:
            raise PolicyError(f"codec policy {spec!r}: unknown codec {codec!r}; known: {', '.join(known)}")
    return ExplicitPolicy(default, tuple(overrides))


def relative_error(codec_name: str, x: torch.Tensor, kind: Kind) -> float:
    """Relative RMS error of a round trip through ``codec_name`` ([n, block, heads, dim] input)."""
    codec = get_codec(codec_name)
    xf = x.to(torch.float32)
    err = codec.decode(codec.encode(x, kind), torch.float32) - xf
    denom = float(xf.pow(2).sum())
    return 0.0 if denom == 0 else float(err.pow(2).sum()) ** 0.5 / denom ** 0.5


@dataclass(frozen=True)
class Calibration:
    codecs: tuple[str, ...]
    errors: tuple[dict[str, float], ...] = field(default_factory=tuple)  # per layer: codec -> error
    budget: float = DEFAULT_BUDGET


def calibrate(samples: list[list[tuple[torch.Tensor, torch.Tensor]]], policy: AutoPolicy) -> Calibration:
    """Pick per layer the cheapest candidate under ``CALIBRATION_MARGIN * budget``.

    ``samples[layer]`` holds (keys, values) block tensors [n, block, heads, dim] from sample prompts."""
    if not samples or any(not s for s in samples):
        raise PolicyError("auto codec calibration needs KV samples for every layer")
    target = policy.budget * CALIBRATION_MARGIN
    chosen: list[str] = []
    errors: list[dict[str, float]] = []
    for layer_samples in samples:
        per_codec: dict[str, float] = {}
        pick = None
        for name in policy.candidates:
            try:
                err = max(max(relative_error(name, k, Kind.KEY), relative_error(name, v, Kind.VALUE))
                          for k, v in layer_samples)
            except CodecError:  # a shape this codec cannot lay out (e.g. int4 with an odd head size)
                continue
            per_codec[name] = err
            if err <= target:
                pick = name
                break
        if pick is None:
            raise PolicyError(f"no candidate codec meets the budget {policy.budget} (errors: {per_codec})")
        chosen.append(pick)
        errors.append(per_codec)
    return Calibration(tuple(chosen), tuple(errors), policy.budget)
