"""Fixtures: real `tether server` processes (binary from $TETHER_BIN, default
target/release/tether at the repository root) on loopback, one data directory per test."""

from __future__ import annotations

import gc
import json
import os
import random
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

import tether

REPO = Path(__file__).resolve().parents[3]


def tether_bin() -> str:
    path = os.environ.get("TETHER_BIN") or str(REPO / "target" / "release" / "tether")
    if not os.access(path, os.X_OK):
        pytest.exit(f"no tether binary at {path} (run `make build` or set TETHER_BIN)", 2)
    return path


def free_port() -> int:
    """A UDP port below the ephemeral range that is free now (a restarted server binds it
    again; the kernel hands out ephemeral ports to others, never this one)."""
    for _ in range(200):
        port = random.randint(20000, 30000)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free UDP port found")


class Server:
    """One `tether server` process; `start` reads its `listening` line."""

    def __init__(self, data_dir: Path, listen: str = "127.0.0.1:0") -> None:
        self.data_dir = data_dir
        self.listen = listen
        self.proc: subprocess.Popen[bytes] | None = None
        self.addr = ""
        self.ca = ""
        self.log = data_dir.parent / f"{data_dir.name}.log"

    def start(self, timeout: float = 30.0) -> Server:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [tether_bin(), "server", "--listen", self.listen, "--metrics", "off",
                 "--data-dir", str(self.data_dir)],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env,
            )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {self.log.read_text()[-2000:]}")
        info = json.loads(line)
        assert info["type"] == "listening", info
        self.addr, self.ca = info["addr"], info["ca"]
        if not os.path.isabs(self.ca):
            self.ca = str(Path(self.ca).resolve())
        # Later stats are not read: keep the pipe from filling.
        self.proc.stdout.close()
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def cli(self, *args: str, timeout: float = 60.0) -> list[dict]:
        """Runs a client command against this server; its JSON lines."""
        out = subprocess.run(
            [tether_bin(), *args, "--server", self.addr, "--ca", self.ca],
            capture_output=True, timeout=timeout, check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"tether {' '.join(args)}: {out.stderr.decode()}")
        return [json.loads(l) for l in out.stdout.decode().splitlines() if l.strip()]

    def subscriber(self, **kw) -> tether.Subscriber:
        """A subscriber of this server; retried while the server still holds the durable id's
        previous session (its close may not have been processed yet)."""
        kw.setdefault("ca_file", self.ca)
        deadline = time.monotonic() + 10
        while True:
            try:
                return tether.Subscriber([self.addr], **kw)
            except tether.ServerError as e:
                if e.code != "duplicate-durable-id" or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def publisher(self, **kw) -> tether.Publisher:
        kw.setdefault("ca_file", self.ca)
        return tether.Publisher([self.addr], **kw)


@pytest.fixture
def server(tmp_path: Path):
    s = Server(tmp_path / "data").start()
    yield s
    gc.collect()
    s.stop()


@pytest.fixture
def make_server(tmp_path: Path):
    """Servers a test starts (and restarts) itself; all stopped at the end."""
    started: list[Server] = []

    def make(data_dir: Path | None = None, listen: str = "127.0.0.1:0") -> Server:
        s = Server(data_dir or tmp_path / f"data{len(started)}", listen)
        started.append(s)
        return s

    yield make
    gc.collect()
    for s in started:
        s.stop()
