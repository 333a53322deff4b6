"""WorkerChannels' bookkeeping (pure logic, over stand-in channels that record ``close``): a forgotten
address is closed only once no call is in flight on it, whichever order calls and ``forget`` race in."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from controlplane.dispatch_channels import GONE_KEPT, WorkerChannels


class _Channel:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


class _Security:
    def __init__(self) -> None:
        self.opened: list[_Channel] = []

    def open_channel(self, target: str, options: Any = ()) -> _Channel:
        self.opened.append(_Channel(target))
        return self.opened[-1]


def _channels(max_calls: int = 4) -> tuple[WorkerChannels, _Security]:
    security = _Security()
    return WorkerChannels(security, 2.0, max_calls), security  # type: ignore[arg-type]  # a stand-in security


def test_forget_closes_an_idle_address_at_once_and_a_busy_one_after_its_last_call():
    channels, security = _channels()
    idle = channels.take("a:1")
    assert idle is not None
    idle.release()
    busy = channels.take("b:2")
    assert busy is not None
    channels.forget("a:1")
    channels.forget("b:2")
    a, b = security.opened
    assert (a.closes, b.closes) == (1, 0)
    assert [(w.address, w.calls, w.retired) for w in channels.held()] == [("b:2", 1, True)]
    late = channels.take("b:2")  # a call starting on the forgotten address shares its entry
    assert late is not None and late.worker is busy.worker
    busy.release()
    busy.release()  # a second release gives nothing back twice
    assert b.closes == 0 and channels.held()[0].calls == 1
    late.release()
    assert b.closes == 1 and channels.held() == ()


def test_a_call_outliving_its_slot_keeps_the_channel_until_its_future_is_done():
    channels, security = _channels()
    slot = channels.take("a:1")
    assert slot is not None
    fut: Future = Future()
    order: list[str] = []
    slot.end_with(fut, lambda _f: order.append("first"))
    slot.release()  # the request ended; its call still runs
    channels.forget("a:1")
    assert security.opened[0].closes == 0 and channels.held()[0].slots_taken == 0
    fut.set_result(None)
    assert order == ["first"] and security.opened[0].closes == 1 and channels.held() == ()


def test_the_cap_counts_slots_and_unknown_or_gone_addresses_open_entries_born_retired():
    channels, security = _channels(max_calls=2)
    slots = [channels.take("a:1"), channels.take("a:1")]
    assert channels.take("a:1") is None  # at its cap
    for s in slots:
        assert s is not None
        s.release()
    channels.forget("z:9")  # unknown: nothing opened, nothing closed
    assert len(security.opened) == 1 and channels.held()[0].address == "a:1"
    w = channels.use("y:8")  # an abort to an address no call holds
    channels.done(w)
    assert security.opened[-1].closes == 1 and [h.address for h in channels.held()] == ["a:1"]
    slot = channels.take("z:9")  # routed on a stale snapshot to a gone worker
    assert slot is not None and channels.held()[-1].retired
    slot.release()
    assert security.opened[-1].closes == 1
    channels.serving("z:9")
    slot = channels.take("z:9")
    assert slot is not None
    slot.release()
    assert security.opened[-1].closes == 0 and [h.address for h in channels.held()] == ["a:1", "z:9"]
    for i in range(GONE_KEPT + 1):
        channels.forget(f"old:{i}")
    assert channels._gone.keys() == {f"old:{i}" for i in range(1, GONE_KEPT + 1)}  # bounded


def test_calls_racing_forget_never_see_their_channel_closed():
    channels, security = _channels(max_calls=64)
    stop = threading.Event()
    seen_closed: list[str] = []

    def caller() -> None:
        while not stop.is_set():
            slot = channels.take("a:1")
            if slot is None:
                continue
            ch = slot.worker.channel
            for _ in range(20):
                if ch.closes:
                    seen_closed.append(ch.address)
            slot.release()

    def forgetter() -> None:
        while not stop.is_set():
            channels.forget("a:1")
            channels.serving("a:1")

    threads = [threading.Thread(target=caller) for _ in range(4)] + [threading.Thread(target=forgetter)]
    for t in threads:
        t.start()
    stop.wait(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert not seen_closed
    channels.forget("a:1")
    assert channels.held() == ()
    assert len(security.opened) > 1 and all(ch.closes == 1 for ch in security.opened)  # each closed once
