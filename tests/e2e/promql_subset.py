"""A small PromQL subset, evaluated over one scrape, to check that a dashboard's queries find series.

Values are not computed: a query evaluates to the label sets of the series it would return, which is
what decides whether a panel shows anything. Supported: selectors with =, !=, =~, !~ matchers and range
``[...]``; numbers; ``vector(n)``; functions that keep their argument's series (rate, irate, increase,
delta, abs, clamp_min, clamp_max); ``histogram_quantile(q, v)`` (needs ``le``, drops it); aggregations
sum/avg/min/max/count with ``by``/``without``; binary + - * / with one-to-one matching (``on``/``ignoring``)
and ``or``/``and``/``unless``. Anything else is a ``PromQLError``, never a silent pass.

An aggregation ``by (l)`` must find ``l`` on its input series (else ``PromQLError``): a label a panel
groups by that the exporter never sets is a broken panel, even though Prometheus returns a result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Labels = frozenset[tuple[str, str]]

TOKEN = re.compile(r"""\s*(?:(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)|(?P<str>"(?:[^"\\]|\\.)*")|(?P<range>\[[^\]]+\])
                      |(?P<op>=~|!~|!=|==|[-+*/(){},=])|(?P<id>[A-Za-z_:][A-Za-z0-9_:]*))""", re.X)
AGGREGATIONS = {"sum", "avg", "min", "max", "count"}
KEEPING = {"rate", "irate", "increase", "delta", "abs", "clamp_min", "clamp_max"}
SET_OPS = {"or", "and", "unless"}


class PromQLError(ValueError):
    pass


@dataclass(frozen=True)
class Series:
    name: str
    labels: dict[str, str]


def tokens(expr: str) -> list[str]:
    out, pos = [], 0
    while pos < len(expr):
        if expr[pos:].strip() == "":
            break
        m = TOKEN.match(expr, pos)
        if m is None or m.end() == pos:
            raise PromQLError(f"cannot read {expr[pos:pos + 20]!r}")
        out.append(m.group().strip())
        pos = m.end()
    return out


class Evaluator:
    """``evaluate(expr)`` -> the label sets (``__name__`` dropped) of the series ``expr`` returns."""

    def __init__(self, series: list[Series]) -> None:
        self.series = series
        self.names_used: set[str] = set()

    def evaluate(self, expr: str) -> set[Labels] | float:
        self.toks, self.i = tokens(expr), 0
        value = self._or()
        if self.i != len(self.toks):
            raise PromQLError(f"unexpected {self.toks[self.i]!r} in {expr!r}")
        return value

    # ------------------------------------------------------------------ grammar (precedence low -> high)
    def _peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def _take(self, want: str | None = None) -> str:
        tok = self._peek()
        if tok is None or (want is not None and tok != want):
            raise PromQLError(f"expected {want!r}, got {tok!r}")
        self.i += 1
        return tok

    def _or(self) -> set[Labels] | float:
        left = self._mul_add()
        while self._peek() in SET_OPS:
            op = self._take()
            right = self._mul_add()
            left = _set_op(op, _vector(left), _vector(right))
        return left

    def _mul_add(self) -> set[Labels] | float:
        left = self._unary()
        while self._peek() in ("+", "-", "*", "/"):
            self._take()
            on = ignoring = None
            if self._peek() in ("on", "ignoring"):
                kind = self._take()
                labels = self._label_list()
                on, ignoring = (labels, None) if kind == "on" else (None, labels)
            right = self._unary()
            left = _arith(left, right, on, ignoring)
        return left

    def _unary(self) -> set[Labels] | float:
        tok = self._peek()
        if tok == "(":
            self._take("(")
            value = self._or()
            self._take(")")
            return value
        if tok is None:
            raise PromQLError("expression ends early")
        if re.fullmatch(r"\d.*", tok):
            return float(self._take())
        name = self._take()
        if name in AGGREGATIONS:
            return self._aggregation(name)
        if self._peek() == "(":
            return self._call(name)
        return self._selector(name)

    def _label_list(self) -> list[str]:
        self._take("(")
        labels = []
        while self._peek() != ")":
            labels.append(self._take())
            if self._peek() == ",":
                self._take(",")
        self._take(")")
        return labels

    def _aggregation(self, name: str) -> set[Labels]:
        by = without = None
        if self._peek() in ("by", "without"):
            kind = self._take()
            by, without = (self._label_list(), None) if kind == "by" else (None, self._label_list())
        self._take("(")
        inner = _vector(self._or())
        self._take(")")
        if self._peek() in ("by", "without"):
            kind = self._take()
            by, without = (self._label_list(), None) if kind == "by" else (None, self._label_list())
        if by is not None:
            for label in by:
                if inner and not any(label in dict(s) for s in inner):
                    raise PromQLError(f"{name} by ({label}): no input series has the label {label!r}")
            return {frozenset((k, v) for k, v in s if k in by) for s in inner}
        if without is not None:
            return {frozenset((k, v) for k, v in s if k not in without) for s in inner}
        return {frozenset()} if inner else set()

    def _call(self, name: str) -> set[Labels] | float:
        self._take("(")
        if name == "vector":
            self._or()
            self._take(")")
            return {frozenset()}
        if name == "histogram_quantile":
            self._or()
            self._take(",")
            inner = _vector(self._or())
            self._take(")")
            if any("le" not in dict(s) for s in inner):
                raise PromQLError("histogram_quantile over series without an le label")
            return {frozenset((k, v) for k, v in s if k != "le") for s in inner}
        if name in KEEPING:
            inner = _vector(self._or())
            while self._peek() == ",":  # clamp_min(v, 0)
                self._take(",")
                self._or()
            self._take(")")
            return inner
        raise PromQLError(f"function {name}() is outside this subset")

    def _selector(self, name: str) -> set[Labels]:
        matchers: list[tuple[str, str, str]] = []
        if self._peek() == "{":
            self._take("{")
            while self._peek() != "}":
                label, op, raw = self._take(), self._take(), self._take()
                if op not in ("=", "!=", "=~", "!~") or not raw.startswith('"'):
                    raise PromQLError(f"bad matcher {label}{op}{raw}")
                matchers.append((label, op, re.sub(r"\\(.)", r"\1", raw[1:-1])))  # \\ -> \, \" -> "
                if self._peek() == ",":
                    self._take(",")
            self._take("}")
        if self._peek() is not None and self._peek().startswith("["):
            self._take()  # a range: over one scrape, the same series
        self.names_used.add(name)
        found = set()
        for s in self.series:
            if s.name == name and all(_match(s.labels.get(label, ""), op, v) for label, op, v in matchers):
                found.add(frozenset(s.labels.items()))
        return found


def _match(value: str, op: str, want: str) -> bool:
    if op == "=":
        return value == want
    if op == "!=":
        return value != want
    hit = re.fullmatch(want, value) is not None
    return hit if op == "=~" else not hit


def _vector(v: set[Labels] | float) -> set[Labels]:
    if isinstance(v, float):
        raise PromQLError("a scalar where a vector belongs")
    return v


def _set_op(op: str, left: set[Labels], right: set[Labels]) -> set[Labels]:
    if op == "or":
        return left | right
    if op == "and":
        return left & right
    return left - right


def _arith(left: set[Labels] | float, right: set[Labels] | float, on: list[str] | None,
           ignoring: list[str] | None) -> set[Labels] | float:
    if isinstance(left, float) and isinstance(right, float):
        return left
    if isinstance(left, float):
        return right
    if isinstance(right, float):
        return left

    def key(s: Labels) -> Labels:
        if on is not None:
            return frozenset((k, v) for k, v in s if k in on)
        if ignoring is not None:
            return frozenset((k, v) for k, v in s if k not in ignoring)
        return s

    keys = {key(s) for s in right}
    return {s for s in left if key(s) in keys}


def parse_exposition(text: str) -> list[Series]:
    """Every sample of a Prometheus text exposition as a Series (sample names: ``_total``, ``_bucket``...)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [Series(s.name, dict(s.labels)) for family in text_string_to_metric_families(text) for s in family.samples]
