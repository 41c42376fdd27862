#!/usr/bin/env python3
"""Replay rate of the Python client next to the Rust client's, in the same run.

Starts a `tether server` on loopback (a fresh data directory), creates one durable queue per
reader with durable interest in every key of region R, publishes N events of B bytes with
`tether put --region R --count N --size B`, then times each reader replaying its queue, one
after the other, from connecting until the live marker (the close after it, keepalive, is
timed apart: most of it is QUIC's draining period, the same for every client):

- python: `tether.Subscriber(durable_id=...)`, blocking iterator, each value read
  (`len(ev.value)`);
- python-batch: `Subscriber.next_batch()` (256 at a time), each value read;
- python-asyncio: the same as python with `async for`;
- rust-lib: the Rust client library alone (`baseline/`: a `Subscription` read the same way,
  no Python; built with cargo unless --no-rust-lib);
- rust-cli: `tether subscribe --durable-id ... --exit-on-live` with stdout to /dev/null,
  timed from process start to exit: this one includes the command line's JSON printing of
  every event, the process start and the close.

Usage: python bench_replay.py [--events 100000] [--size 128] [--bin target/release/tether]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tether

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def build_rust_baseline() -> str:
    """Builds the Rust baseline (cargo; quick when up to date) and returns its path."""
    target = Path(os.environ.get("CARGO_TARGET_DIR") or HERE / "target")
    subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "tether-replay-baseline"],
                   cwd=HERE, check=True, env=dict(os.environ, CARGO_TARGET_DIR=str(target)))
    return str(target / "release" / "tether-replay-baseline")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=128, help="value bytes")
    ap.add_argument("--bin", default=os.environ.get("TETHER_BIN")
                    or str(REPO / "target" / "release" / "tether"))
    ap.add_argument("--no-rust-lib", action="store_true",
                    help="skip the Rust library baseline (it needs cargo)")
    args = ap.parse_args()
    baseline = None if args.no_rust_lib else build_rust_baseline()

    with tempfile.TemporaryDirectory(prefix="tether-pybench-") as tmp:
        proc = subprocess.Popen(
            [args.bin, "server", "--listen", "127.0.0.1:0", "--metrics", "off",
             "--data-dir", os.path.join(tmp, "data")],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            info = json.loads(proc.stdout.readline() if ready else b"{}")
            if info.get("type") != "listening":
                print("error: the server did not start", file=sys.stderr)
                return 1
            addr, ca = info["addr"], info["ca"]
            common = ["--server", addr, "--ca", ca]

            readers = ["python", "python-batch", "python-asyncio", "rust-cli"]
            if baseline:
                readers.insert(3, "rust-lib")
            # One durable queue per reader, with durable interest in every key of R; then away.
            for r in readers:
                with tether.Subscriber([addr], ca_file=ca, durable_id=r,
                                       interests={"R": tether.all_keys()}) as sub:
                    for ev in sub:
                        if isinstance(ev, tether.Live):
                            break

            t0 = time.perf_counter()
            subprocess.run([args.bin, "put", "--region", "R", "--count", str(args.events),
                            "--size", str(args.size)] + common,
                           stdout=subprocess.DEVNULL, check=True)
            publish_s = time.perf_counter() - t0

            # Each returns (seconds to the live marker, seconds of the close, events, bytes).
            def python() -> tuple[float, float | None, int, int]:
                t0 = time.perf_counter()
                n = nbytes = 0
                sub = tether.Subscriber([addr], ca_file=ca, durable_id="python")
                assert sub.pending == args.events, sub.pending
                for ev in sub:
                    if type(ev) is tether.Event:
                        n += 1
                        nbytes += len(ev.value)
                    elif type(ev) is tether.Live:
                        break
                t1 = time.perf_counter()
                sub.close()
                return t1 - t0, time.perf_counter() - t1, n, nbytes

            def python_batch() -> tuple[float, float | None, int, int]:
                t0 = time.perf_counter()
                n = nbytes = 0
                sub = tether.Subscriber([addr], ca_file=ca, durable_id="python-batch")
                assert sub.pending == args.events, sub.pending
                live = False
                while not live:
                    for ev in sub.next_batch(256):
                        if type(ev) is tether.Event:
                            n += 1
                            nbytes += len(ev.value)
                        elif type(ev) is tether.Live:
                            live = True
                            break
                t1 = time.perf_counter()
                sub.close()
                return t1 - t0, time.perf_counter() - t1, n, nbytes

            async def python_asyncio() -> tuple[float, float | None, int, int]:
                t0 = time.perf_counter()
                n = nbytes = 0
                sub = await tether.Subscriber.open([addr], ca_file=ca,
                                                   durable_id="python-asyncio")
                async for ev in sub:
                    if type(ev) is tether.Event:
                        n += 1
                        nbytes += len(ev.value)
                    elif type(ev) is tether.Live:
                        break
                t1 = time.perf_counter()
                await sub.aclose()
                return t1 - t0, time.perf_counter() - t1, n, nbytes

            def rust_lib() -> tuple[float, float | None, int, int]:
                out = subprocess.run([baseline, addr, ca, "rust-lib"], capture_output=True,
                                     check=True, text=True).stdout
                r = json.loads(out)
                return r["live_secs"], r["close_secs"], r["events"], r["bytes"]

            def rust_cli() -> tuple[float, float | None, int, int]:
                t0 = time.perf_counter()
                subprocess.run([args.bin, "subscribe", "--region", "R", "--durable-id",
                                "rust-cli", "--exit-on-live"] + common,
                               stdout=subprocess.DEVNULL, check=True)
                return time.perf_counter() - t0, None, args.events, args.events * args.size

            runs = {"python": python, "python-batch": python_batch,
                    "python-asyncio": lambda: asyncio.run(python_asyncio()),
                    "rust-lib": rust_lib, "rust-cli": rust_cli}
            results = {}
            for r in readers:
                secs, close, n, nbytes = runs[r]()
                if (n, nbytes) != (args.events, args.events * args.size):
                    print(f"error: {r} replayed {n} events, {nbytes} bytes", file=sys.stderr)
                    return 1
                results[r] = (args.events / secs, close)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)

    notes = {
        "python": "blocking iterator, each value read; connect to live marker",
        "python-batch": "next_batch(256), each value read; connect to live marker",
        "python-asyncio": "async for, each value read; connect to live marker",
        "rust-lib": "tether-client Subscription, each value read; connect to live marker",
        "rust-cli": "`tether subscribe --exit-on-live` > /dev/null; includes process start, "
                    "the close and the CLI's JSON printing of every event",
    }
    print(f"replay of {args.events} events of {args.size} B "
          f"(published in {publish_s:.2f} s), same server, one after the other:")
    for r, (rate, close) in results.items():
        after = "" if close is None else f"; then close {close * 1000:.0f} ms"
        print(f"  {r:15} {rate:>12,.0f} events/s   ({notes[r]}{after})")
    py = results["python"][0]
    for r in ("python-batch", "rust-lib", "rust-cli"):
        if r in results:
            print(f"  python / {r}: {py / results[r][0]:.2f}")
    print(json.dumps({"events": args.events, "size": args.size,
                      **{f"{r}_events_per_s": round(v[0]) for r, v in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
