"""``freeze_startup_heap`` in a fresh interpreter (it changes the process's collector for good): what
was alive is exempted, and garbage made afterwards is still collected."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.unit]

SCRIPT = """
import gc, weakref
from controlplane.heap import freeze_startup_heap

class Node:
    pass

kept = [Node() for _ in range(1000)]
walked_before = len(gc.get_objects())  # what a full collection walks (the permanent generation is not)
frozen = freeze_startup_heap("test")
assert frozen >= 1000 and gc.get_freeze_count() == frozen, frozen
assert len(gc.get_objects()) < walked_before - 1000, (walked_before, len(gc.get_objects()))
# a cycle made after start-up is garbage the collector still finds
a, b = Node(), Node()
a.other, b.other = b, a
probe = weakref.ref(a)
del a, b
gc.collect()
assert probe() is None, "a cycle created after the freeze was not collected"
print("ok", frozen)
"""


def test_start_up_objects_are_exempted_and_later_garbage_is_still_collected():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
