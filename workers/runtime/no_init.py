"""Build modules without running their parameter initialisers.

A module's constructor fills its parameters with random values (``torch.nn.init``) that a checkpoint then
overwrites: for a 1.1B model on CPU that is about 3.5 s of wasted work. On the ``meta`` device the same
initialisers go through torch's Python decompositions, whose first call imports ``torch._dynamo`` and
Triton: about 1 s and 140 MB in every process that builds a model for its shapes only. Inside
``uninitialised()`` each ``torch.nn.init`` function that torch lets a mode intercept (``uniform_``,
``normal_``, ``constant_``, ``kaiming_uniform_``: what nn.Linear, nn.Embedding and nn.Conv2d use) returns its
tensor untouched, through the public ``TorchFunctionMode`` API; the others (``ones_``, ``zeros_``,
``xavier_*``, ...) still run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class _SkipInit(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")  # (torch passes it by name)
            if isinstance(tensor, torch.Tensor):
                return tensor  # the initialisers work in place and return their tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def uninitialised(device: torch.device | str | None = None) -> Iterator[None]:
    """Modules built inside get parameters whose memory holds whatever it held (on ``device`` when given,
    as ``with torch.device(device)``): for weights a checkpoint overwrites next, every one of them, or for
    shapes only on ``meta``."""
    with contextlib.ExitStack() as stack:
        if device is not None:
            stack.enter_context(torch.device(device))
        stack.enter_context(_SkipInit())
        yield
