"""The suite's result types and their JSON form (``epd.bench.micro/1``).

A :class:`Result` is one figure of one benchmark, measured ``repeats`` times, each time beside its
reference measured in the same repeat. The ratio is taken per repeat (figure / reference), so a
machine that is busier in one repeat slows both sides of that ratio; the min/median/max of the
ratios is the run-to-run spread that ``--compare`` judges a change against.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

SCHEMA = "epd.bench.micro/1"
Better = Literal["higher", "lower"]


class ResultsFileError(ValueError):
    """A results file that cannot be read as this suite's JSON; the message names the file and the problem."""


@dataclass(frozen=True)
class Spread:
    """min / median / max of a list of positive numbers."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, xs: tuple[float, ...] | list[float]) -> Spread:
        if not xs:
            raise ValueError("a spread needs at least one value")
        return cls(min(xs), statistics.median(xs), max(xs))

    def to_json(self) -> dict[str, float]:
        return {"min": self.min, "median": self.median, "max": self.max}


@dataclass(frozen=True)
class Result:
    """One figure beside its in-run reference, ``len(values)`` repeats of each.

    ``unit`` is the unit of both ``values`` and ``ref_values``; ``better`` says which way is good for
    the figure, and so for the ratio (figure / reference) too.
    """

    name: str  # "<benchmark>.<what>", e.g. "codec.int8.encode"
    benchmark: str  # the --only name that produced it
    unit: str
    better: Better
    reference: str  # what the reference is, in words
    values: tuple[float, ...]
    ref_values: tuple[float, ...]
    note: str = ""

    def __post_init__(self) -> None:
        if not self.values or len(self.values) != len(self.ref_values):
            raise ValueError(f"{self.name}: {len(self.values)} values vs {len(self.ref_values)} reference values")
        if any(not (v > 0) for v in (*self.values, *self.ref_values)):  # also refuses NaN
            raise ValueError(f"{self.name}: figures must be positive, got {self.values} / {self.ref_values}")
        if self.better not in ("higher", "lower"):
            raise ValueError(f"{self.name}: better must be 'higher' or 'lower', got {self.better!r}")

    @property
    def ratios(self) -> tuple[float, ...]:
        return tuple(v / r for v, r in zip(self.values, self.ref_values))

    @property
    def value(self) -> Spread:
        return Spread.of(self.values)

    @property
    def ref(self) -> Spread:
        return Spread.of(self.ref_values)

    @property
    def ratio(self) -> Spread:
        return Spread.of(self.ratios)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "benchmark": self.benchmark, "unit": self.unit, "better": self.better,
                "reference": self.reference, "note": self.note, "values": list(self.values),
                "ref_values": list(self.ref_values), "ratios": list(self.ratios), "value": self.value.to_json(),
                "ref": self.ref.to_json(), "ratio": self.ratio.to_json()}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Result:
        return cls(name=str(raw["name"]), benchmark=str(raw["benchmark"]), unit=str(raw["unit"]),
                   better=raw["better"], reference=str(raw["reference"]),
                   values=tuple(float(v) for v in raw["values"]),
                   ref_values=tuple(float(v) for v in raw["ref_values"]), note=str(raw.get("note", "")))


@dataclass
class SuiteRun:
    """Everything one ``epd bench micro`` run measured, plus what failed and how long each part took."""

    meta: dict[str, Any] = field(default_factory=dict)
    results: list[Result] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # benchmark -> what went wrong
    seconds: dict[str, float] = field(default_factory=dict)  # benchmark -> wall seconds
    notes: list[str] = field(default_factory=list)

    @property
    def benchmarks(self) -> list[str]:
        """The benchmarks this run attempted, in order."""
        return list(self.seconds)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "meta": self.meta, "benchmarks": self.benchmarks, "seconds": self.seconds,
                "errors": self.errors, "notes": self.notes, "results": [r.to_json() for r in self.results]}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, raw: Any, source: str = "results") -> SuiteRun:
        if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
            got = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
            raise ResultsFileError(f"{source}: not an `epd bench micro` results file (schema {got!r}, "
                                   f"expected {SCHEMA!r})")
        try:
            results = [Result.from_json(r) for r in raw["results"]]
            seconds = {str(k): float(v) for k, v in raw.get("seconds", {}).items()}
            errors = {str(k): str(v) for k, v in raw.get("errors", {}).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ResultsFileError(f"{source}: malformed results ({type(exc).__name__}: {exc})") from None
        return cls(meta=dict(raw.get("meta", {})), results=results, errors=errors, seconds=seconds,
                   notes=list(raw.get("notes", [])))

    @classmethod
    def read(cls, path: Path) -> SuiteRun:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ResultsFileError(f"cannot read {path}: {exc.strerror or exc}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ResultsFileError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_json(raw, str(path))
