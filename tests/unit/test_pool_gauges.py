"""/metrics's pool gauges read Redis; a stalled read must not stall the scrape."""

from __future__ import annotations

import threading
import time

import pytest

from controlplane.observability import metrics
from controlplane.observability.metrics import ClusterSnapshot, DecodeKV, PoolSnapshot

pytestmark = [pytest.mark.unit]

SNAPSHOT = ClusterSnapshot((PoolSnapshot("decode", 2, 2, 1, 0),), (DecodeKV("decode-1", 3, 5),))


class SlowSource:
    """A snapshot that takes as long as the test says (a Redis whose client is retrying)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.reads = 0

    def snapshot(self) -> ClusterSnapshot:
        self.reads += 1
        self.release.wait(10)
        return SNAPSHOT


@pytest.fixture
def slow():
    source = SlowSource()
    metrics.bind_cluster(source)
    yield source
    source.release.set()
    metrics.bind_cluster(None)


def test_a_scrape_waits_at_most_a_second_for_the_pool_gauges_then_goes_on_without_them(slow):
    started = time.monotonic()
    body = metrics.exposition().decode()
    assert time.monotonic() - started < metrics.CLUSTER_WAIT_S + 1.0
    assert "epd:replicas_desired" not in body  # left out of this scrape
    assert "# TYPE epd:requests_total counter" in body  # the rest of the scrape is all there
    body = metrics.exposition().decode()  # a second scrape meanwhile starts no second read
    assert slow.reads == 1
    slow.release.set()
    deadline = time.monotonic() + 5
    model = metrics.MODEL.value
    while f'epd:replicas_desired{{model_name="{model}",pool="decode"}} 2.0' not in body and time.monotonic() < deadline:
        time.sleep(0.05)
        body = metrics.exposition().decode()
    assert f'epd:replicas_desired{{model_name="{model}",pool="decode"}} 2.0' in body
    assert f'epd:kv_blocks_free{{model_name="{model}",worker_id="decode-1"}} 5.0' in body
