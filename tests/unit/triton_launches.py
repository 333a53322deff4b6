"""Record every Triton launch the interpreter runs, as the specialisation a GPU would compile, and compile
those specialisations for a Hopper GPU (sm_90) without one.

A kernel launched on a GPU is compiled once per specialisation of its arguments: the dtype of each
tensor (and whether its address is a multiple of 16), each int's width (i32/i64; a multiple of 16 gets a
divisibility hint; an int equal to 1 becomes the constant 1), each constexpr's value and the launch
options. The interpreter never compiles, so a kernel can pass every interpreter test and still be
refused by the compiler for one of the specialisations the engine launches (an int that is 1 only on
the GPU's shapes, a constexpr combination no hand-written signature listed). ``record()`` turns the
launches of interpreted code into those specialisations (Triton's rules, restated here so only public
APIs are used); ``compile_all`` compiles each with ``triton.compile`` in a process where Triton is not
interpreted.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator
from typing import Any

_PTR = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int8": "i8",
        "torch.uint8": "u8", "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64", "torch.bool": "i1",
        "torch.float8_e4m3fn": "fp8e4nv", "torch.float8_e5m2": "fp8e5"}
PROJECT = ("workers.", "kvtransfer.")  # the modules whose kernels ``compile_all`` compiles
MAX_SHARED = 227 * 1024  # bytes of shared memory one block may take on sm_90 (opted in)
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg", "launch_cooperative_grid")


def _is_constexpr(param: inspect.Parameter) -> bool:
    ann = param.annotation
    return ann is not inspect.Parameter.empty and "constexpr" in (ann if isinstance(ann, str) else repr(ann))


def _arg(value: Any) -> list[Any]:
    """[type, attribute or constant] as Triton specialises a non-constexpr argument."""
    if value is None:
        return ["constexpr", None]
    if isinstance(value, bool):
        return ["u1", None]
    if isinstance(value, int):
        if value == 1:
            return ["constexpr", 1]
        kind = "i32" if -2**31 <= value < 2**31 else "i64" if -2**63 <= value < 2**63 else "u64"
        return [kind, "D" if value % 16 == 0 else ""]
    if isinstance(value, float):
        return ["fp32", None]
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return ["*" + _PTR[str(value.dtype)], "D" if value.data_ptr() % 16 == 0 else ""]
    raise TypeError(f"no Triton specialisation known for a {type(value).__name__} argument")


def specialisation(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The specialisation of one launch of the @triton.jit function ``fn`` (its Python function)."""
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip((p.name for p in params), args)) | {k: v for k, v in kwargs.items() if k not in _OPTIONS}
    sig: dict[str, list[Any]] = {}
    for p in params:
        value = bound[p.name] if p.name in bound else p.default
        if _is_constexpr(p):
            if not isinstance(value, (int, float, bool, str, type(None))):
                raise TypeError(f"{fn.__name__}: constexpr {p.name} is a {type(value).__name__}")
            sig[p.name] = ["constexpr", value]
        else:
            sig[p.name] = _arg(value)
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    return {"module": fn.__module__, "name": fn.__name__, "signature": sig, "options": options}


@contextlib.contextmanager
def record() -> Iterator[list[dict[str, Any]]]:
    """Within the block, each interpreted launch adds its specialisation (once) to the yielded list.
    Needs ``TRITON_INTERPRET=1`` set before the kernels were decorated."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    original = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        spec = specialisation(self.fn, args, kwargs)
        key = json.dumps(spec, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(spec)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run  # restored below
    try:
        yield out
    finally:
        InterpretedFunction.run = original


def compile_all(specs: list[dict[str, Any]], capability: int = 90) -> list[str]:
    """Compile every specialisation of a kernel of this project (``PROJECT``) for ``cuda`` at ``capability``;
    one line per failure (none: all compiled). Run where Triton is not interpreted."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    failures = []
    for spec in specs:
        if not spec["module"].startswith(PROJECT):
            continue  # a test's own kernel: importing its module switches the interpreter on
        fn = getattr(importlib.import_module(spec["module"]), spec["name"])
        sig = {name: t for name, (t, _) in spec["signature"].items()}
        const = {name: v for name, (t, v) in spec["signature"].items() if t == "constexpr"}
        attrs = {(i,): [["tt.divisibility", 16]] for i, (t, a) in enumerate(spec["signature"].values())
                 if t != "constexpr" and a == "D"}
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=target,
                                    options=dict(spec["options"]))
        except Exception as e:  # noqa: BLE001  # every failure is reported, with its specialisation
            first = str(e).strip().splitlines()
            failures.append(f"{spec['name']} {json.dumps(spec['signature'])} {spec['options']}: "
                            f"{type(e).__name__}: {first[-1] if first else ''}")
            continue
        if kernel.metadata.shared > MAX_SHARED:  # the GPU would refuse the launch (OutOfResources)
            failures.append(f"{spec['name']} {json.dumps(spec['signature'])}: {kernel.metadata.shared} bytes of "
                            f"shared memory, more than a Hopper block's {MAX_SHARED}")
    return failures


# As a pytest plugin (``-p triton_launches`` with tests/unit on the path and TRITON_LAUNCH_RECORD=FILE):
# record the launches of the whole run into FILE, for ``compile_all``.
_session: contextlib.ExitStack | None = None
_specs: list[dict[str, Any]] = []


def pytest_configure(config: Any) -> None:
    import os

    global _session, _specs
    if os.environ.get("TRITON_LAUNCH_RECORD"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
        _session = contextlib.ExitStack()
        _specs = _session.enter_context(record())


def pytest_unconfigure(config: Any) -> None:
    import os

    if _session is not None:
        _session.close()
        with open(os.environ["TRITON_LAUNCH_RECORD"], "w") as f:
            json.dump(_specs, f)
