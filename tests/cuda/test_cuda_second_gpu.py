"""KV work on a second GPU, driven from threads whose current CUDA device is 0 (every new thread's): the
codec, checksum and landing kernels run on their tensors' GPU, and leaving a side stream creates no CUDA
context on GPU 0. Pool replicas see every GPU of their node, so a decode worker on GPU 1 does exactly this
on its gRPC threads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvtransfer.codecs import Kind, get_codec
from kvtransfer.device_checksum import kernel_checksum, reference_checksum
from kvtransfer.policy import relative_error
from tests.cuda.helpers import CUDA

pytestmark = [*CUDA, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def in_new_thread(fn):
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def test_codec_kernels_run_on_their_tensors_gpu() -> None:
    """As an encoder or a receiver thread calls them: the bytes equal the torch codec's on the CPU."""
    x = torch.randn(4, 16, 4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for name in ("int8", "fp8", "int4"):
        codec = get_codec(name)
        want = codec.encode(x, Kind.KEY)
        got = in_new_thread(lambda c=codec: c.encode(x.to("cuda:1"), Kind.KEY))
        assert torch.equal(got.payload.cpu(), want.payload) and torch.equal(got.scales.cpu(), want.scales), name
        back = in_new_thread(lambda c=codec, e=got: c.decode(e, torch.float32))
        assert back.device == torch.device("cuda:1") and torch.equal(back.cpu(), codec.decode(want, torch.float32))


def test_calibration_round_trips_run_on_their_tensors_gpu() -> None:
    x = torch.randn(4, 16, 4, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for name in ("int8", "fp8"):
        want = relative_error(name, x, Kind.VALUE)
        assert in_new_thread(lambda c=name: relative_error(c, x.to("cuda:1"), Kind.VALUE)) == pytest.approx(want,
                                                                                                             rel=1e-5)


def test_the_checksum_kernel_runs_on_its_tensors_gpu() -> None:
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    assert in_new_thread(lambda: kernel_checksum(data.to("cuda:1"))) == reference_checksum(data)


def test_leaving_a_side_stream_on_gpu_1_opens_no_context_on_gpu_0() -> None:
    # in a fresh process, so that nothing else has touched GPU 0 (torch's only public view of a primary
    # context is this private call)
    code = textwrap.dedent("""
        import threading, torch
        from kvtransfer.staging import side_stream
        def work():
            with side_stream(torch.device("cuda:1"), independent=True):
                torch.ones(1 << 20, device="cuda:1").sum()
        t = threading.Thread(target=work); t.start(); t.join()
        print(torch._C._cuda_hasPrimaryContext(0), torch._C._cuda_hasPrimaryContext(1))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
