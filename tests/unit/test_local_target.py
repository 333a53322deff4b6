"""Which KV targets are on this host (auto picks shared memory or CUDA IPC for those): loopback, a Unix
socket, and any address of this host's own, which is what workers in an external Ray cluster bind."""

from __future__ import annotations

import pytest

from kvtransfer.sender import is_local_target, own_address

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize("target, local", [
    ("127.0.0.1:50051", True), ("localhost:50051", True), ("[::1]:50051", True), ("unix:/tmp/epd.sock", True),
    ("127.0.0.5:50051", True),  # all of 127/8 is this host's
    ("192.0.2.1:50051", False),  # TEST-NET-1: routable nowhere, never an address of this host
    ("[2001:db8::1]:50051", False),  # the IPv6 documentation prefix
    ("decode-0.epd.svc:50051", False),  # a name: not resolved, so not taken as local
])
def test_local_targets_are_this_hosts_addresses(target: str, local: bool) -> None:
    assert is_local_target(target) is local


def test_an_address_counts_as_this_hosts_only_when_it_is_one() -> None:
    assert own_address("127.0.0.2") and not own_address("192.0.2.7") and not own_address("2001:db8::7")


_NONLOCAL_BIND_PROBE = """
import socket, sys
from kvtransfer.sender import is_local_target
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.bind(("10.9.9.9", 0))  # not this namespace's address, yet it binds: ip_nonlocal_bind is on
print(is_local_target("10.9.9.1:50051"), is_local_target("10.9.9.9:50051"))
"""


def test_an_address_that_only_binds_is_not_this_hosts() -> None:
    """With net.ipv4.ip_nonlocal_bind=1 every address binds; a receiver on another host must still not be
    taken for local (auto would pick shared memory, which cannot cross hosts). Run in a network namespace of
    its own (unshare), where the sysctl is set without touching this host's."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2)")
    # 10.9.9.1 is this namespace's; the rest of 10.9.9.0/24 is routed (through lo), as another host's would be
    setup = ("ip link set lo up && ip addr add 10.9.9.1/32 dev lo && ip route add 10.9.9.0/24 dev lo && "
             "sysctl -qw net.ipv4.ip_nonlocal_bind=1")
    made = subprocess.run(["unshare", "-rn", "sh", "-c", setup], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    out = subprocess.run(["unshare", "-rn", "sh", "-c", f'{setup} && exec "$0" -c "$1"', sys.executable,
                          _NONLOCAL_BIND_PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]  # its own address is local; the other, bindable, is not


def test_this_hosts_own_network_address_is_local() -> None:
    """What an external Ray cluster's workers bind: the node's address, found here as the source address of a
    route out (a UDP connect sends nothing)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            pytest.skip("no route out of this host: no address of its own but loopback")
        ip = s.getsockname()[0]
    if ip.startswith("127."):
        pytest.skip("this host's only address is loopback")
    assert is_local_target(f"{ip}:50051")
