"""The soak's report (``epd bench chaos --soak``): memory per request served, counts by kind, the exit
verdict, the printed lines; and the pieces it reads with: /proc memory and streamed answers."""

from __future__ import annotations

import os

import httpx
import pytest

from bench.chaos.load import Outcome
from bench.chaos.procs import memory_bytes
from bench.chaos.report import SoakReport, SoakSample, format_soak, kind_counts, per_request_bytes
from bench.chaos.workload import MixedWorkload, _events

MiB = 2**20


def _sample(at: float, served: int, anon: int, rss: int | None = None) -> SoakSample:
    rss = anon + 100 * MiB if rss is None else rss
    return SoakSample(at, {"prefill p-1": rss, "raylet (7)": 30 * MiB}, 0, {"decode d-1": 2},
                      {"prefill p-1": anon, "raylet (7)": 20 * MiB}, served)


def _report(**kw) -> SoakReport:
    samples = [_sample(10.0, 100, 500 * MiB), _sample(70.0, 1100, 510 * MiB), _sample(100.0, 1600, 515 * MiB),
               _sample(130.0, 2100, 520 * MiB)]
    base = dict(minutes=2.0, capacity_rps=20.0, rate_rps=14.0, requests=2100, failed=0, matched=1500,
                rss_growth_pct={"prefill p-1": 1.6, "raylet (7)": 0.0}, blocks_baseline=0, blocks_end=0,
                samples=samples, warmup_s=60.0, journal_cap=500, mix=True, checked=1500,
                anon_growth_pct={"prefill p-1": 2.0, "raylet (7)": 0.0},
                kinds={"greedy": (1500, 0), "malformed": (600, 0)},
                idle=_sample(175.0, 2100, 400 * MiB), idle_s=45.0, retried=3, retries=4, retries_on_429=5)
    base.update(kw)
    return SoakReport(**base)  # type: ignore[arg-type]


def test_per_request_bytes_is_the_least_squares_slope_over_requests_served() -> None:
    samples = [_sample(0, 0, 100 * MiB), _sample(1, 1000, 110 * MiB), _sample(2, 2000, 100 * MiB + 20 * MiB)]
    assert per_request_bytes(samples, "prefill p-1") == pytest.approx(10 * MiB / 1000)
    noisy = [_sample(0, 0, 100 * MiB), _sample(1, 1000, 112 * MiB), _sample(2, 2000, 120 * MiB)]
    assert per_request_bytes(noisy, "prefill p-1") == pytest.approx(10 * MiB / 1000)
    assert per_request_bytes(samples[:2], "prefill p-1") is None  # too few to say
    assert per_request_bytes([_sample(t, 5, t * MiB) for t in range(3)], "prefill p-1") is None  # no load
    assert per_request_bytes(samples, "decode d-9") is None


def test_kind_counts_sent_and_failed_per_kind() -> None:
    outs = [Outcome(0, 1, 200, "", True, "a"), Outcome(0, 1, 0, "boom", False, "", "long", False),
            Outcome(0, 1, 200, "", False, "", "long", False), Outcome(0, 1, 400, "", False, "", "malformed", False)]
    assert kind_counts(outs) == {"greedy": (1, 0), "long": (2, 1), "malformed": (1, 0)}


def test_a_differing_answer_or_a_kept_block_fails_the_soak() -> None:
    assert _report().ok
    assert not _report(matched=1499).ok
    assert not _report(failed=1).ok
    assert not _report(blocks_end=3).ok


def test_the_printed_report_gives_kinds_anonymous_memory_per_request_and_idle() -> None:
    text = format_soak(_report())
    assert "mixed load" in text and "1500/1500 answered with a reference equal to generate()" in text
    assert "by kind (sent/failed): greedy 1500/0, malformed 600/0" in text
    assert "3 requests were answered 429 (full) and sent again after its Retry-After (4 times in all)" in text
    assert "prefill p-1" in text and "anon +2.0% (510.0 -> 520.0 MiB)" in text
    assert "prefill p-1 +10.2 KiB" in text  # 10 MiB over 1000 requests, from the samples after warm-up
    assert "raylet (7) +" not in text.split("per request served")[1].split("\n")[0]  # workers only
    assert "45 s after the load stopped (at its end -> idle): prefill p-1 520.0 -> 400.0 MiB" in text
    assert "preemptions" not in text  # none reported (a soak against an API that does not say)
    text = format_soak(_report(preemptions={"prefill p-1": 0, "decode d-1": 4}))
    assert "engine preemptions (each worker's count at the end): decode d-1 4, prefill p-1 0" in text
    assert _report(preemptions={"decode d-1": 4}).ok  # a latency cost, not a failed request


def test_memory_bytes_reads_resident_and_anonymous_memory() -> None:
    rss, anon = memory_bytes(os.getpid()) or (0, 0)
    assert rss >= anon > 10 * MiB  # this interpreter has torch loaded
    assert memory_bytes(2**22 + 12345) is None  # past pid_max: no such process


def test_a_stream_must_end_with_done_and_an_error_event_fails_it() -> None:
    good = httpx.Response(200, content=b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
    assert [e["choices"][0]["text"] for e in _events(good)] == ["a"]
    with pytest.raises(ValueError, match="without \\[DONE\\]"):
        list(_events(httpx.Response(200, content=b'data: {"choices": [{"text": "a"}]}\n\n')))
    with pytest.raises(ValueError, match="error event in the stream: the KV never came"):
        list(_events(httpx.Response(200, content=b'data: {"error": {"message": "the KV never came"}}\n\n')))


def test_the_mixed_load_draws_the_same_requests_every_run() -> None:
    from bench.chaos.workload import GreedyWorkload

    def kinds(seed: int, images: bool) -> list[tuple[str, str]]:
        w = MixedWorkload(GreedyWorkload("http://x", "m", [[1]], [""], 4), 8192, images, seed=seed)
        return [w.kind_of(n)[:2] for n in range(300)]

    assert kinds(0, True) == kinds(0, True) != kinds(1, True)
    assert {k for k, _ in kinds(0, True)} >= {"image", "long", "cancel_prefill", "malformed"}
    assert not any(k == "image" or v == "bad_image" for k, v in kinds(0, False))  # a text-only model


class _FullTwice:
    """A workload whose every request is answered 429 twice (Retry-After 0), then 200."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def send(self, client: httpx.Client, n: int) -> Outcome:
        self.sent.append(n)
        full = self.sent.count(n) <= 2
        return Outcome(float(len(self.sent)), float(len(self.sent)), 429 if full else 200,
                       "HTTP 429: full" if full else "", not full, "", retry_after_s=0.0)


@pytest.mark.parametrize("retries, status, tries", [(5, 200, 2), (1, 429, 1), (0, 429, 0)])
def test_the_driver_sends_a_429_again_at_most_as_often_as_asked(retries: int, status: int, tries: int) -> None:
    import time

    from bench.chaos.load import LoadDriver

    w = _FullTwice()
    driver = LoadDriver(w, concurrency=1, retries_on_429=retries).start()
    end = time.monotonic() + 10
    while driver.count < 1 and time.monotonic() < end:
        time.sleep(0.001)
    driver.stop()
    first = driver.outcomes[0]
    assert (first.status, first.retries, first.ok) == (status, tries, status == 200)
    assert w.sent[:tries + 1] == [0] * (tries + 1) and first.start == 1.0  # the same request; its first start


class _AlwaysFull:
    def send(self, client: httpx.Client, n: int) -> Outcome:
        return Outcome(0.0, 0.0, 429, "HTTP 429: full", False, "", retry_after_s=30.0)


def test_a_request_waiting_to_be_sent_again_when_the_run_ends_is_not_counted_as_failed() -> None:
    import time

    from bench.chaos.load import LoadDriver

    driver = LoadDriver(_AlwaysFull(), concurrency=2, retries_on_429=5).start()
    time.sleep(0.2)  # both lanes are waiting out a 30 s Retry-After
    driver.stop(join_s=5)
    assert driver.outcomes == []  # cut short by the end of the run, not failures of the server
