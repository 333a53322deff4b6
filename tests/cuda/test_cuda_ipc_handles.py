"""CUDA IPC through torch's public reduce/rebuild functions, across two processes: the segment a second process
maps from an exported handle is the exporting process's memory, both ways. CUDA opens no handle in the process
that exported it (the in-process tests take the pool's tensors as they are), so only another process checks
the handle itself. Needs the generated wire code (``CudaIpcLease``): gpu-check runs it with the KV steps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.cuda.helpers import CUDA

pytestmark = CUDA

# The sender's side, in its own process: map the leased segment from the lease's bytes (hex on stdin), report
# the sum of what is there, and overwrite it with a pattern.
CHILD = r"""
import sys
import torch
from kvtransfer.cuda_ipc import IpcMappings
from kvtransfer.wire import pb

lease = pb.CudaIpcLease.FromString(bytes.fromhex(sys.stdin.read().strip()))
seg = IpcMappings().open("receiver", lease)
assert seg.is_cuda and seg.numel() == lease.segment_bytes, (seg.device, seg.shape)
seen = int(seg.to(torch.int64).sum())
seg.copy_(torch.arange(seg.numel(), device=seg.device).remainder(251).to(torch.uint8))
torch.cuda.synchronize()
print(seen)
"""


def _wire() -> None:
    try:
        import kvtransfer.wire  # noqa: F401
    except Exception as e:  # noqa: BLE001  # any import failure of the generated code skips, named
        pytest.skip(f"the generated wire code does not import here: {e!r}")


def test_another_process_maps_the_exported_segment_both_ways() -> None:
    _wire()
    from kvtransfer.cuda_ipc import IpcPool

    pool = IpcPool(torch.device("cuda"), 1 << 16, num_segments=2)
    lease = pool.lease("r", 1 << 10)
    seg = pool.check("r", lease.pool_epoch, lease.segment)
    seg.fill_(3)
    torch.cuda.synchronize()
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", CHILD], input=lease.SerializeToString().hex(), capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(3 * seg.numel()), "the child saw other memory"
    want = torch.arange(seg.numel(), device="cuda").remainder(251).to(torch.uint8)
    assert torch.equal(seg, want), "the child's writes did not land in the exported segment"
    pool.release("r")
