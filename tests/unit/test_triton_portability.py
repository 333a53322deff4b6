"""Triton kernels mean the same bits on every Triton the project meets, not only on this checkout's.

The H200 image runs triton 3.6, whose front end lowers a unary minus on a float to ``0 - x``: that turns -0.0
into +0.0, so a kernel that negates a value that can be zero stores other bits there than the torch
reference (triton 3.7 and later emit a true negation). The interpreter this checkout tests with has the
later behaviour, so no kernel test can see it: this test reads the kernels' source instead. A negation in a
``@triton.jit`` function must go another way (a sign bit, ``x * -1.0``), unless its operand is a constant or
a name below, each of which cannot be a signed zero where it is negated.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
KERNEL_DIRS = [ROOT / "workers" / "runtime" / "kernels", ROOT / "kvtransfer" / "codecs", ROOT / "kvtransfer"]
# expression -> why its operand's sign of zero cannot change what is stored
ALLOWED = {
    "-qmax": "qmax is the cache's largest code (127 or 448), never zero",
    "-g": "only under exp(), and exp(-0) == exp(+0)",
}


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _negations(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not (isinstance(fn, ast.FunctionDef) and _is_jit(fn)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                operand = node.operand
                if isinstance(operand, ast.Constant):
                    continue
                if isinstance(operand, ast.Name) and operand.id.isupper():  # a module constant (INF, ...)
                    continue
                found.append((node.lineno, ast.get_source_segment(source, node) or "?"))
    return found


def _kernel_files() -> list[Path]:
    return sorted(p for d in KERNEL_DIRS for p in d.glob("*.py") if "triton.jit" in p.read_text())


def test_the_scan_sees_the_kernels_and_a_negation(tmp_path: Path) -> None:
    files = _kernel_files()
    assert len(files) >= 10, files
    sample = tmp_path / "sample.py"
    sample.write_text("import triton\n\n\n@triton.jit\ndef f(x):\n    return -x\n\n\ndef g(x):\n    return -x\n")
    assert _negations(sample) == [(6, "-x")]  # the jit function's, not the host function's


def test_no_kernel_negates_a_value_that_can_be_a_signed_zero() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line}: {expr}" for p in _kernel_files() for line, expr in _negations(p)
           if expr not in ALLOWED]
    assert not bad, "unary minus in a Triton kernel (triton < 3.7 makes -0.0 +0.0 there):\n" + "\n".join(bad)


def test_every_allowed_negation_is_still_there() -> None:
    seen = {expr for p in _kernel_files() for _, expr in _negations(p)}
    assert set(ALLOWED) <= seen, f"no longer in any kernel, drop from ALLOWED: {set(ALLOWED) - seen}"
