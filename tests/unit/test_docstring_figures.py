"""Docstrings state contracts (units, invariants), never measurements: a throughput figure in a docstring of
the product packages is a run's result, which belongs in docs/performance.md with the command behind it.

Read from the source with ``ast`` (nothing is imported); only docstrings are checked (module, class and
function), since a rate there can only be a measurement, while a number in code is a setting.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit]

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("controlplane", "workers", "kvtransfer")
# a number followed by a rate: 6 GB/s, 1,757 GB/s, 0.8 MiB/s, 65 tok/s, 455 req/s, 110 requests/s
THROUGHPUT = re.compile(r"\d[\d,]*(\.\d+)?\s?(?:[KMGT]i?B/s|[KMGT]bit/s|tok(?:ens)?/s|req(?:uests)?/s)\b")
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def figures_in_docstrings(source: str, where: str) -> list[str]:
    """``where:line: figure`` for each throughput figure in a docstring of ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, DOCUMENTED) or not node.body:
            continue
        first = node.body[0]
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            continue
        for match in THROUGHPUT.finditer(first.value.value):
            line = first.lineno + first.value.value.count("\n", 0, match.start())
            found.append(f"{where}:{line}: {match.group(0)!r}")
    return found


def test_no_throughput_figure_in_a_docstring():
    found = [hit for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))
             for hit in figures_in_docstrings(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "docstrings state contracts, not measurements (figures go to docs/performance.md):\n" + \
        "\n".join(found)


def test_the_check_sees_a_figure_in_any_docstring_and_not_elsewhere():
    source = '''"""Moves 1,757 GB/s."""
RATE = "3.7 GB/s"  # a string in code is not a docstring
class C:
    """Decodes at 65 tok/s."""
    def f(self):
        """Serves
        455 req/s and 6GB/s and 2 MiB/s."""
        return "12 tok/s"
async def g():
    """A 10 ms timeout and a 256 MiB budget are contracts."""
'''
    assert figures_in_docstrings(source, "m.py") == [
        "m.py:1: '1,757 GB/s'", "m.py:4: '65 tok/s'", "m.py:7: '455 req/s'", "m.py:7: '6GB/s'", "m.py:7: '2 MiB/s'"]
