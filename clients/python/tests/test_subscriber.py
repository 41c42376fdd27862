"""Durable and non-durable subscribers against a real server: the durable life cycle (new,
away, resumed with replay), blocking and asyncio iteration, automatic and manual acks."""

from __future__ import annotations

import asyncio
import gc
import signal
import subprocess
import sys
import threading
import time

import pytest

import tether


def until_live(it, limit: int = 1_000_000) -> tuple[list[tether.Event], tether.Live]:
    """Events up to the live marker, and the marker."""
    events = []
    for ev in it:
        if isinstance(ev, tether.Live):
            return events, ev
        assert isinstance(ev, tether.Event), ev
        events.append(ev)
        assert len(events) <= limit
    raise AssertionError("the subscription ended before the live marker")


def take(sub: tether.Subscriber, n: int, timeout: float = 10.0) -> list[tether.Event]:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        ev = sub.next(timeout=max(0.0, deadline - time.monotonic()))
        assert ev is not None, f"timed out after {len(out)} of {n} events"
        out.append(ev)
    return out


class Ticker:
    """Counts the event loop's turns, one every 10 ms: the loop keeps running while a client
    waits. Made inside a running loop; `stop` when done."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0.01)

    def stop(self) -> None:
        self._task.cancel()


def test_durable_client_is_new_then_resumes_and_replays_what_was_published_meanwhile(server):
    interests = {"R": [tether.regex("D-.*")]}
    with server.subscriber(durable_id="d1", interests=interests) as sub:
        assert (sub.queue_status, sub.pending) == ("new", None)
        events, live = until_live(sub)
        assert events == [] and live.regions == ["R"]
    # Away (closed with keepalive): what is published meanwhile is queued.
    with server.publisher() as pub:
        for i in range(5):
            pub.put("R", f"D-{i}", f"v{i}")
        pub.put("R", "other", b"not matched")
    with server.subscriber(durable_id="d1") as sub:  # durable interest kept by the server
        assert (sub.queue_status, sub.pending) == ("resumed", 5)
        events, live = until_live(sub)
        assert [(e.key, e.value, e.op) for e in events] == [
            (f"D-{i}", f"v{i}".encode(), "create") for i in range(5)
        ]
        assert all(e.replayed and not e.possible_duplicate for e in events)
        assert [e.offset for e in events] == [1, 2, 3, 4, 5]
        assert live.regions == ["R"]
        with server.publisher() as pub:
            pub.put("R", "D-0", "v0b")
            pub.destroy("R", "D-1")
        live_events = take(sub, 2)
        assert [(e.key, e.op, e.value, e.replayed) for e in live_events] == [
            ("D-0", "update", b"v0b", False),
            ("D-1", "destroy", None, False),
        ]
        assert "-" in live_events[0].event_id and live_events[0].region == "R"
    with server.subscriber(durable_id="d1") as sub:
        assert (sub.queue_status, sub.pending) == ("resumed", 0)
        assert until_live(sub)[0] == []


def test_asyncio_iteration_replays_then_goes_live(server):
    server.cli("put", "--region", "P", "--count", "3", "--key-prefix", "EUR")
    with server.subscriber(durable_id="a1", interests={"P": tether.all_keys()}) as sub:
        until_live(sub)  # registers durable interest in P

    server.cli("put", "--region", "P", "--count", "300", "--key-prefix", "EUR", "--size", "16")

    async def main() -> tuple[list, list, str, int | None]:
        sub = await tether.Subscriber.open([server.addr], ca_file=server.ca, durable_id="a1")
        replayed, live = [], []
        ticker = Ticker()
        async with sub:
            async for ev in sub.events():
                if isinstance(ev, tether.Live):
                    break
                replayed.append(ev)
            pub = await tether.Publisher.open([server.addr], ca_file=server.ca)
            await asyncio.to_thread(pub.put, "P", "EUR-live", b"x")
            async for ev in sub:
                live.append(ev)
                break
            pub.close()
            await asyncio.sleep(0.1)
        ticker.stop()
        assert ticker.ticks > 5
        return replayed, live, sub.queue_status, sub.pending

    replayed, live, status, pending = asyncio.run(main())
    assert (status, pending) == ("resumed", 300)
    assert len(replayed) == 300 and all(e.replayed for e in replayed)
    assert [e.offset for e in replayed] == list(range(1, 301))
    assert [(e.key, e.replayed) for e in live] == [("EUR-live", False)]


def test_non_durable_subscriber_sees_live_events_only(server):
    with server.publisher() as pub:
        pub.put("R", "k1", b"before")
        with server.subscriber(interests={"R": [tether.keys(["k1", "k2"])]}) as sub:
            assert (sub.queue_status, sub.pending) == ("none", None)
            assert sub.initial == [("R", "k1", b"before")]
            # A non-durable client has nothing to replay: live once its interest is registered.
            assert sub.next(5) == tether.Live(regions=["R"])
            pub.put("R", "k1", b"after")
            pub.put("R", "k3", b"not registered")
            pub.put("R", "k2", b"new")
            events = [sub.next(5) for _ in range(2)]
            assert [(e.key, e.value, e.replayed, e.possible_duplicate) for e in events] == [
                ("k1", b"after", False, False), ("k2", b"new", False, False)]
            assert sub.next(0.2) is None
    with server.subscriber(interests={"R": tether.key("k1")}) as sub:
        assert sub.queue_status == "none"


def test_auto_acks_count_what_the_application_asked_past(server):
    with server.subscriber(durable_id="auto", interests={"R": tether.all_keys()}) as sub:
        until_live(sub)
    server.cli("put", "--region", "R", "--count", "5")
    sub = server.subscriber(durable_id="auto")
    assert sub.pending == 5
    first = take(sub, 3)
    assert [e.offset for e in first] == [1, 2, 3]
    sub.close()  # the third was yielded: processed at close (the rest was read ahead only)
    sub.close()  # twice: nothing
    assert sub.finished and list(sub) == []
    with server.subscriber(durable_id="auto") as sub:
        assert (sub.queue_status, sub.pending) == ("resumed", 2)
        events, _ = until_live(sub)
        assert [(e.offset, e.replayed, e.possible_duplicate) for e in events] == [
            (4, True, True), (5, True, True)]
        with pytest.raises(tether.UsageError, match="automatic"):
            sub.ack(5)


def test_batches_come_in_order_and_auto_acks_cover_every_event_of_a_batch(server):
    with server.subscriber(durable_id="batches", interests={"R": tether.all_keys()}) as sub:
        until_live(sub)
    server.cli("put", "--region", "R", "--count", "20")
    sub = server.subscriber(durable_id="batches")
    assert sub.pending == 20
    got: list[tether.Event] = []
    while len(got) < 6:
        batch = sub.next_batch(3, timeout=10)
        assert 1 <= len(batch) <= 3, batch
        assert all(isinstance(e, tether.Event) and e.replayed for e in batch), batch
        got.extend(batch)
    assert [e.offset for e in got] == list(range(1, len(got) + 1))
    # Closing counts every event handed out as processed, the last batch's too: with only
    # the last offset of a batch acked, the cumulative ack would stay below the gap.
    sub.close()
    with server.subscriber(durable_id="batches") as sub:
        assert (sub.queue_status, sub.pending) == ("resumed", 20 - len(got))
        rest: list[tether.Event] = []
        live = None
        while live is None:
            for item in sub.next_batch(timeout=10):
                if isinstance(item, tether.Live):
                    live = item
                else:
                    rest.append(item)
        assert [e.offset for e in rest] == list(range(len(got) + 1, 21))
        assert all(e.replayed for e in rest)
        # Nothing after the live marker, and a timeout is an empty list.
        assert sub.next_batch(timeout=0.05) == []


def test_asyncio_batches_replay_in_order_keep_the_loop_running_and_end_empty(server):
    with server.subscriber(durable_id="abatch", interests={"R": tether.all_keys()}) as sub:
        until_live(sub)
    server.cli("put", "--region", "R", "--count", "50", "--size", "16")

    async def main() -> tuple[list, list, list]:
        sub = await tether.Subscriber.open([server.addr], ca_file=server.ca,
                                           durable_id="abatch")
        got, sizes = [], []
        ticker = Ticker()
        live = None
        while live is None:
            batch = await sub.anext_batch(8)
            assert batch, "a batch before the live marker is never empty"
            sizes.append(len(batch))
            for item in batch:
                if isinstance(item, tether.Live):
                    live = item
                else:
                    got.append(item)
        # Nothing arrives for a while: the loop keeps ticking during the wait.
        waiting = asyncio.create_task(sub.anext_batch())
        before = ticker.ticks
        await asyncio.sleep(0.3)
        assert not waiting.done() and ticker.ticks > before + 5
        await asyncio.to_thread(sub.close)
        after_close = await asyncio.wait_for(waiting, 10)
        ticker.stop()
        return got, sizes, after_close

    got, sizes, after_close = asyncio.run(main())
    assert [e.offset for e in got] == list(range(1, 51))
    assert all(e.replayed for e in got)
    assert max(sizes) <= 8
    assert after_close == []  # closed while waiting: finished, an empty list
    with server.subscriber(durable_id="abatch") as sub:  # auto acks covered every batch
        assert (sub.queue_status, sub.pending) == ("resumed", 0)


def test_manual_acks_out_of_order_and_a_checkpoint_restart_see_no_event_twice(server):
    with server.subscriber(durable_id="m1", interests={"R": tether.all_keys()}) as sub:
        until_live(sub)
    server.cli("put", "--region", "R", "--count", "6")
    # Acks reach the server only at a clean close here (the interval is long), so a crash
    # leaves everything unacknowledged on the server: only the checkpoint knows.
    sub = server.subscriber(durable_id="m1", ack_mode="manual", ack_interval_ms=600_000)
    assert sub.pending == 6
    events, _ = until_live(sub)
    assert [e.offset for e in events] == [1, 2, 3, 4, 5, 6]
    assert sub.ack(2) == 0 and sub.ack(3) == 0  # held: 1 is still in progress
    assert sub.ack(1) == 3
    assert sub.ack(5) == 3
    checkpoint = sub.ack(4)
    assert checkpoint == 5
    with pytest.raises(tether.UsageError, match="never delivered"):
        sub.ack(99)
    # The process dies (no close, no ack sent).
    del sub
    gc.collect()

    sub = server.subscriber(durable_id="m1", ack_mode="manual", checkpoint=checkpoint)
    assert (sub.queue_status, sub.pending) == ("resumed", 6)
    events, _ = until_live(sub)
    assert [(e.offset, e.possible_duplicate) for e in events] == [(6, True)]
    assert sub.ack(6) == 6
    sub.close()
    with server.subscriber(durable_id="m1") as sub:
        assert (sub.queue_status, sub.pending) == ("resumed", 0)


def test_a_closed_queue_without_keepalive_is_gone(server):
    sub = server.subscriber(durable_id="gone", interests={"R": tether.all_keys()})
    until_live(sub)
    sub.close(keepalive=False)
    server.cli("put", "--region", "R", "--key", "k", "--value", "v")
    with server.subscriber(durable_id="gone") as sub:
        assert (sub.queue_status, sub.pending) == ("new", None)


def test_a_replay_of_thousands_of_events_arrives_in_order_and_is_all_acked(server):
    with server.subscriber(durable_id="big", interests={"B": tether.all_keys()}) as sub:
        until_live(sub)
    server.cli("put", "--region", "B", "--count", "20000", "--size", "64")
    with server.subscriber(durable_id="big", batch_size=500) as sub:
        assert sub.pending == 20000
        n, last = 0, 0
        for ev in sub:
            if isinstance(ev, tether.Live):
                break
            assert ev.offset == last + 1 and len(ev.value) == 64
            last = ev.offset
            n += 1
        assert n == 20000
    with server.subscriber(durable_id="big") as sub:
        assert sub.pending == 0


def test_a_paced_replay_keeps_its_rate_and_loses_nothing(server):
    with server.subscriber(durable_id="paced", interests={"P": tether.all_keys()}) as sub:
        until_live(sub)
    server.cli("put", "--region", "P", "--count", "400", "--size", "16")
    started = time.monotonic()
    with server.subscriber(durable_id="paced", replay_rate=1000) as sub:
        events, _ = until_live(sub)
        took = time.monotonic() - started
    assert [e.offset for e in events] == list(range(1, 401))
    assert all(e.replayed for e in events)
    # 100 events of credit at once, the other 300 at 1,000 per second: a lower bound only.
    assert took >= 0.25, f"400 events at 1000/s took only {took:.3f} s"
    with pytest.raises(ValueError, match="replay_rate"):
        server.subscriber(durable_id="paced", replay_rate=-1)


def test_next_with_a_timeout_returns_none_when_nothing_comes(server):
    with server.subscriber(durable_id="t1", interests={"R": tether.all_keys()}) as sub:
        assert isinstance(sub.next(5), tether.Live)
        t0 = time.monotonic()
        assert sub.next(timeout=0.3) is None
        assert 0.25 <= time.monotonic() - t0 < 2
        assert not sub.finished


def test_a_close_from_another_thread_ends_a_blocked_iteration(server):
    sub = server.subscriber(durable_id="th", interests={"R": tether.all_keys()})
    assert isinstance(sub.next(5), tether.Live)
    seen: list = []
    done = threading.Event()

    def consume() -> None:
        for ev in sub:  # blocks: nothing is published
            seen.append(ev)
        done.set()

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    sub.close()
    assert done.wait(5), "the iteration did not stop"
    assert time.monotonic() - t0 < 2 and seen == []
    t.join()


def test_ctrl_c_interrupts_a_blocked_iteration(server):
    code = (
        "import sys, tether\n"
        "sub = tether.Subscriber([sys.argv[1]], ca_file=sys.argv[2], durable_id='cc',\n"
        "                        interests={'R': tether.all_keys()})\n"
        "print('ready', flush=True)\n"
        "try:\n"
        "    for ev in sub:\n"
        "        pass\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, server.addr, server.ca],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # blocked in the iteration by now
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=10)
    assert out.strip() == "interrupted" and p.returncode == 0
    assert time.monotonic() - t0 < 3


def test_event_objects_compare_and_print_as_python_values():
    assert tether.Live(["R"]) == tether.Live(regions=["R"]) != tether.Live(["S"])
    assert repr(tether.Live(["R"])) == "Live(regions=['R'])"
    assert repr(tether.Disconnected("lost")) == "Disconnected(error='lost')"
    assert tether.Reconnected("resumed", 3).pending == 3
    assert repr(tether.Reconnected("new")) == "Reconnected(queue='new', pending=None)"
