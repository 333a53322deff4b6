"""What one ``epd bench serve`` run is asked to do, validated before anything is sent.

Every check here raises ``BenchInputError`` with a message that names the bad value, so the CLI can print
it and exit 2 without a traceback; the Python API (``run_serve_bench``) raises the same error.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

Endpoint = Literal["chat", "completions"]
DatasetName = Literal["random", "sharegpt", "prefix", "multimodal"]
SLO_METRICS = ("ttft", "tpot", "e2e")  # what --goodput may name; values in milliseconds


class BenchInputError(ValueError):
    """A bad flag, file, URL or server answer that makes the benchmark impossible (exit 2)."""


@dataclass(frozen=True)
class SLO:
    """Upper bounds in milliseconds; ``None`` = not constrained. A request meets the SLO when every set bound
    holds (a TPOT bound holds trivially for a one-token answer, which has no TPOT, as in vLLM)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def is_empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None

    def as_dict(self) -> dict[str, float]:
        return {name: value for name, value in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms),
                                                ("e2e", self.e2e_ms)) if value is not None}


def parse_slo(items: list[str] | str | None) -> SLO:
    """``["ttft:200", "tpot:50"]`` (or one string, space- or comma-separated) -> SLO. Raises BenchInputError."""
    if items is None:
        return SLO()
    if isinstance(items, str):
        items = [items]
    tokens = [t for item in items for t in re.split(r"[\s,]+", item.strip()) if t]
    values: dict[str, float] = {}
    for token in tokens:
        name, sep, raw = token.partition(":")
        name = name.strip().lower()
        name = "e2e" if name == "e2el" else name  # vLLM's spelling of end-to-end latency
        if not sep or name not in SLO_METRICS:
            raise BenchInputError(f"bad SLO {token!r}: expected METRIC:MS with METRIC one of "
                                  f"{', '.join(SLO_METRICS)} (e2el: e2e) (e.g. ttft:200 tpot:50)")
        try:
            ms = float(raw)
        except ValueError:
            raise BenchInputError(f"bad SLO {token!r}: {raw!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms <= 0:
            raise BenchInputError(f"impossible SLO {token!r}: the bound must be a positive number of milliseconds")
        if name in values:
            raise BenchInputError(f"SLO {name!r} given twice")
        values[name] = ms
    return SLO(values.get("ttft"), values.get("tpot"), values.get("e2e"))


def normalize_url(url: str) -> str:
    """The API base ending in ``/v1`` (``http://h:p``, ``http://h:p/``, ``http://h:p/v1`` all work)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchInputError(f"bad URL {url!r}: expected http(s)://HOST[:PORT][/v1]")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise BenchInputError(f"bad URL {url!r}: the port is not a number in 0-65535") from None
    if parts.query or parts.fragment:
        raise BenchInputError(f"bad URL {url!r}: no query or fragment expected")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


def parse_float_list(text: str, what: str, *, allow_inf: bool = False) -> list[float]:
    """``"1,2,4"`` -> [1.0, 2.0, 4.0]; ``inf`` allowed where ``allow_inf`` (all requests at once)."""
    out: list[float] = []
    for raw in text.split(","):
        raw = raw.strip()
        try:
            value = float(raw)
        except ValueError:
            raise BenchInputError(f"bad {what} {raw!r} in {text!r}: not a number") from None
        if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
            raise BenchInputError(f"bad {what} {raw!r}: must be a positive number"
                                  + (" or inf" if allow_inf else ""))
        out.append(value)
    return out


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """``"224x224,512x384"`` -> [(224, 224), (512, 384)] as (width, height)."""
    sizes = []
    for raw in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", raw)
        if not m or not (1 <= int(m[1]) <= 8192 and 1 <= int(m[2]) <= 8192):
            raise BenchInputError(f"bad image size {raw!r}: expected WIDTHxHEIGHT, each 1-8192 (e.g. 224x224)")
        sizes.append((int(m[1]), int(m[2])))
    return sizes


@dataclass(frozen=True)
class DatasetConfig:
    """Which prompts to send. Lengths are in tokens (approximate without a tokenizer; see datasets.py)."""

    name: DatasetName = "random"
    num_prompts: int = 100
    input_len: int = 256  # random, multimodal: mean prompt tokens; prefix: the unique suffix length
    output_len: int = 64  # max_tokens asked for (sharegpt: None = the reference answer's length)
    range_ratio: float = 0.0  # lengths drawn uniformly from [len*(1-r), len*(1+r)]
    path: Path | None = None  # sharegpt JSON file
    sharegpt_output_len: int | None = None  # override the reference answer's length
    num_prefixes: int = 4
    prefix_len: int = 256
    image_sizes: tuple[tuple[int, int], ...] = ((224, 224),)
    images_per_request: int = 1
    tokenizer: Path | None = None  # HF folder or tokenizer.json: exact token counts

    def validate(self) -> None:
        if self.num_prompts < 1:
            raise BenchInputError(f"--num-prompts must be >= 1 (got {self.num_prompts})")
        if self.input_len < 1 or self.output_len < 1:
            raise BenchInputError("--input-len and --output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise BenchInputError(f"--range-ratio must be in [0, 1) (got {self.range_ratio})")
        if self.name == "sharegpt" and self.path is None:
            raise BenchInputError("--dataset sharegpt needs --dataset-path FILE (a ShareGPT-format JSON list)")
        if self.name == "prefix" and (self.num_prefixes < 1 or self.prefix_len < 1):
            raise BenchInputError("--num-prefixes and --prefix-len must be >= 1")
        if self.name == "multimodal" and self.images_per_request < 1:
            raise BenchInputError("--images-per-request must be >= 1")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise BenchInputError("--sharegpt-output-len must be >= 1")


@dataclass(frozen=True)
class ServeBenchConfig:
    """One benchmark: a target, a dataset, and one or more load points (a sweep over ``rates``).

    ``rates`` are requests/s (``inf`` = send all at once); ``concurrency`` caps requests in flight (with
    ``rates=(inf,)`` it is a closed loop at that concurrency). ``burstiness`` is the gamma shape of the
    inter-arrival times: 1 = Poisson, < 1 burstier, > 1 more regular.
    """

    url: str
    model: str | None = None  # None = the first of GET /v1/models
    endpoint: Endpoint | None = None  # None = chat for multimodal, completions otherwise
    api_key: str | None = None
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    rates: tuple[float, ...] = (math.inf,)
    concurrency: int | None = None
    burstiness: float = 1.0
    warmup: int = 2
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    slo: SLO = field(default_factory=SLO)
    request_timeout_s: float = 600.0
    progress: bool = True
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")  # vLLM's flat keys: which metrics
    metric_percentiles: tuple[float, ...] = (99.0,)  # ... and which percentiles (p99_ttft_ms)

    def resolved_endpoint(self) -> Endpoint:
        if self.endpoint is not None:
            return self.endpoint
        return "chat" if self.dataset.name == "multimodal" else "completions"

    def validate(self) -> None:
        normalize_url(self.url)
        self.dataset.validate()
        if not self.rates:
            raise BenchInputError("no request rate given")
        for r in self.rates:
            if math.isnan(r) or r <= 0:
                raise BenchInputError(f"bad request rate {r}: must be positive (or inf)")
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchInputError(f"--concurrency must be >= 1 (got {self.concurrency})")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise BenchInputError(f"--burstiness must be a positive number (got {self.burstiness})")
        if self.warmup < 0:
            raise BenchInputError("--warmup must be >= 0")
        if not (self.request_timeout_s > 0 and math.isfinite(self.request_timeout_s)):
            raise BenchInputError(f"--request-timeout must be a positive number of seconds (got "
                                  f"{self.request_timeout_s})")
        if not (0 <= self.temperature < math.inf):
            raise BenchInputError(f"--temperature must be a number >= 0 (got {self.temperature})")
        if not 0 <= self.seed < 2**63:
            raise BenchInputError(f"--seed must be an integer in [0, 2^63) (got {self.seed})")
        bad = [m for m in self.percentile_metrics if m not in ("ttft", "tpot", "itl", "e2el")]
        if bad or not self.percentile_metrics:
            raise BenchInputError(f"--percentile-metrics takes a comma list of ttft, tpot, itl, e2el (got "
                                  f"{','.join(self.percentile_metrics) or 'nothing'})")
        if not self.metric_percentiles or not all(0 < p < 100 for p in self.metric_percentiles):
            raise BenchInputError("--metric-percentiles takes a comma list of numbers in (0, 100), e.g. 50,90,99")
        if self.dataset.name == "multimodal" and self.resolved_endpoint() != "chat":
            raise BenchInputError("--dataset multimodal sends images, which only --endpoint chat can carry")
