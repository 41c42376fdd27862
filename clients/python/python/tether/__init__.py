"""Tether's Python client: durable subscriptions and publishing over QUIC+TLS.

A thin layer over the Rust client library (``tether-client``, compiled into
``tether._native``): this module checks arguments and offers the Pythonic surface; connections,
reconnection, duplicate suppression and acknowledgements are the Rust library's.

    import tether

    with tether.Subscriber(["127.0.0.1:7400"], ca_file="data/tls/ca.pem",
                           durable_id="dash-1",
                           interests={"prices": [tether.regex("EUR.*")]}) as sub:
        print(sub.queue_status, sub.pending)
        for ev in sub:                      # blocks; `async for ev in sub` under asyncio
            if isinstance(ev, tether.Event):
                print(ev.key, ev.value, ev.replayed)
            elif isinstance(ev, tether.Live):
                break

See docs/python.md for the whole API.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from . import _native
from ._native import (
    ClosedError,
    ConnectError,
    Disconnected,
    Event,
    Live,
    ProtocolError,
    Reconnected,
    ServerError,
    TetherError,
    TlsError,
    UsageError,
)

__all__ = [
    "Subscriber",
    "Publisher",
    "Interest",
    "key",
    "keys",
    "regex",
    "all_keys",
    "Event",
    "Live",
    "Disconnected",
    "Reconnected",
    "ClientEvent",
    "TetherError",
    "ConnectError",
    "ServerError",
    "TlsError",
    "ProtocolError",
    "ClosedError",
    "UsageError",
    "DEFAULT_SERVER",
    "DEFAULT_CA_FILE",
]

#: What a subscriber yields.
ClientEvent = Union[Event, Live, Disconnected, Reconnected]

#: The server contacted when none is given (as the command line).
DEFAULT_SERVER = "127.0.0.1:7400"
#: The CA file trusted when neither ``ca_file`` nor ``ca_pem`` is given, if it exists (the dev
#: CA a server started in the current directory generates; as the command line).
DEFAULT_CA_FILE = os.path.join("data", "tls", "ca.pem")

_POLICIES = ("keys-values", "keys", "none")
_U64_MAX = 2**64 - 1
# The most items `Subscriber.next_batch` hands out at once.
_BATCH_EVENTS_MAX = 1 << 20

# ---------------------------------------------------------------------------------------------
# Argument checks: one clear TypeError or ValueError naming the argument.


def _type_name(v: object) -> str:
    return type(v).__name__


def _str(name: str, v: object) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected str, got {_type_name(v)}")
    return v


def _opt_str(name: str, v: object) -> str | None:
    return None if v is None else _str(name, v)


def _int(name: str, v: object, lo: int = 0, hi: int = _U64_MAX) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected int, got {_type_name(v)}")
    if not lo <= v <= hi:
        raise ValueError(f"{name}: {v} is outside {lo} to {hi}")
    return v


def _opt_int(name: str, v: object, lo: int = 0, hi: int = _U64_MAX) -> int | None:
    return None if v is None else _int(name, v, lo, hi)


def _number(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a number of seconds, got {_type_name(v)}")
    if not v >= 0 or v == float("inf"):
        raise ValueError(f"{name}: {v} is not a number of seconds >= 0")
    return float(v)


def _bool(name: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name}: expected bool, got {_type_name(v)}")
    return v


def _path(name: str, v: object) -> str | None:
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a path (str or os.PathLike), got {_type_name(v)}")
    return os.fspath(v)


def _bytes(name: str, v: object) -> bytes:
    """Values: bytes as they are, str as UTF-8, other buffers (bytearray, memoryview) copied."""
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode("utf-8")
    if isinstance(v, (bytearray, memoryview)):
        return bytes(v)
    raise TypeError(f"{name}: expected bytes or str, got {_type_name(v)}")


def _servers(v: object) -> list[str]:
    if isinstance(v, str):
        out = [s.strip() for s in v.split(",") if s.strip()]
    elif isinstance(v, Iterable) and not isinstance(v, (bytes, bytearray, Mapping)):
        out = []
        for i, s in enumerate(v):
            if not isinstance(s, str):
                raise TypeError(f"servers[{i}]: expected str 'HOST:PORT', got {_type_name(s)}")
            out.append(s)
    else:
        raise TypeError(
            f"servers: expected 'HOST:PORT' or a list of them, got {_type_name(v)}"
        )
    if not out:
        raise ValueError("servers: the list is empty")
    return out


def _ca(ca_file: object, ca_pem: object) -> tuple[str | None, bytes | None]:
    path = _path("ca_file", ca_file)
    pem = None if ca_pem is None else _bytes("ca_pem", ca_pem)
    if path is None and pem is None and os.path.exists(DEFAULT_CA_FILE):
        path = DEFAULT_CA_FILE
    return path, pem


# ---------------------------------------------------------------------------------------------
# Interest


@dataclass(frozen=True)
class Interest:
    """Interest in keys of one region; made by :func:`key`, :func:`keys`, :func:`regex` and
    :func:`all_keys`, given per region to :class:`Subscriber`."""

    kind: Literal["key", "keys", "regex", "all-keys"]
    specs: tuple[str, ...] = ()
    #: None: durable for a durable client.
    durable: bool | None = None
    #: Initial image: "keys-values", "keys" or "none".
    policy: str = "keys-values"
    #: False: creates and updates arrive as invalidates without values.
    receive_values: bool = True

    def __post_init__(self) -> None:
        if self.durable is not None:
            _bool("durable", self.durable)
        _bool("receive_values", self.receive_values)
        _str("policy", self.policy)
        if self.policy not in _POLICIES:
            raise ValueError(
                f"policy: expected one of {', '.join(_POLICIES)}, got {self.policy!r}"
            )

    def _wire(self, region: str) -> tuple[str, str, list[str], bool | None, str, bool]:
        return (region, self.kind, list(self.specs), self.durable, self.policy,
                self.receive_values)


def key(k: str, *, durable: bool | None = None, policy: str = "keys-values",
        receive_values: bool = True) -> Interest:
    """Interest in one key."""
    return Interest("key", (_str("key", k),), durable, policy, receive_values)


def keys(ks: Iterable[str], *, durable: bool | None = None, policy: str = "keys-values",
         receive_values: bool = True) -> Interest:
    """Interest in a list of keys."""
    if isinstance(ks, (str, bytes)) or not isinstance(ks, Iterable):
        raise TypeError(f"keys: expected a list of str, got {_type_name(ks)}")
    items = tuple(_str(f"keys[{i}]", k) for i, k in enumerate(ks))
    return Interest("keys", items, durable, policy, receive_values)


def regex(pattern: str, *, durable: bool | None = None, policy: str = "keys-values",
          receive_values: bool = True) -> Interest:
    """Interest in the keys matching a regular expression (whole-key match, Rust syntax)."""
    return Interest("regex", (_str("regex", pattern),), durable, policy, receive_values)


def all_keys(*, durable: bool | None = None, policy: str = "keys-values",
             receive_values: bool = True) -> Interest:
    """Interest in every key of the region."""
    return Interest("all-keys", (), durable, policy, receive_values)


def _interests(v: object) -> list[tuple[str, str, list[str], bool | None, str, bool]]:
    if v is None:
        return []
    if not isinstance(v, Mapping):
        raise TypeError(
            "interests: expected a dict of region -> interest (or list of interests), "
            f"got {_type_name(v)}"
        )
    out = []
    for region, spec in v.items():
        if not isinstance(region, str):
            raise TypeError(f"interests: region names must be str, got {_type_name(region)}")
        items = [spec] if isinstance(spec, Interest) else spec
        if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            raise TypeError(
                f"interests[{region!r}]: expected an Interest (tether.key, tether.keys, "
                f"tether.regex, tether.all_keys) or a list of them, got {_type_name(spec)}"
            )
        for i, it in enumerate(items):
            if not isinstance(it, Interest):
                raise TypeError(
                    f"interests[{region!r}][{i}]: expected an Interest (tether.key, "
                    f"tether.keys, tether.regex, tether.all_keys), got {_type_name(it)}"
                )
            out.append(it._wire(region))
    return out


# ---------------------------------------------------------------------------------------------
# Subscriber


class Subscriber:
    """A subscription that connects, registers its interest, says it is ready, and (with
    ``reconnect=True``) survives lost connections, resuming its durable queue.

    Iterate it with ``for ev in sub`` (blocking) or ``async for ev in sub`` (asyncio); it
    yields :class:`Event`, :class:`Live`, :class:`Disconnected` and :class:`Reconnected`.
    Connecting happens in the constructor; errors raise :class:`TetherError` subclasses.
    """

    def __init__(
        self,
        servers: str | Iterable[str] = (DEFAULT_SERVER,),
        *,
        interests: Mapping[str, Interest | Iterable[Interest]] | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        ca_pem: bytes | str | None = None,
        durable_id: str | None = None,
        timeout_secs: int = 300,
        redundancy: int = 0,
        reconnect: bool = True,
        reconnect_max_secs: float = 600,
        reconnect_delay_initial_ms: int = 100,
        reconnect_delay_max_ms: int = 5000,
        reconnect_attempt_timeout_ms: int = 2000,
        ack_mode: Literal["auto", "manual"] = "auto",
        checkpoint: int | None = None,
        server_name: str | None = None,
        token: str | None = None,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
        failure_timeout_ms: int | None = None,
        ack_interval_ms: int = 100,
        name: str = "tether-python",
        batch_size: int = 1024,
        replay_rate: int = 0,
    ) -> None:
        self._native: Any = None
        ca_path, pem = _ca(ca_file, ca_pem)
        if _str("ack_mode", ack_mode) not in ("auto", "manual"):
            raise ValueError(f"ack_mode: expected 'auto' or 'manual', got {ack_mode!r}")
        if durable_id is not None and not _str("durable_id", durable_id):
            raise ValueError("durable_id: must not be empty")
        self._native = _native.subscribe(
            _servers(servers),
            interests=_interests(interests),
            ca_file=ca_path,
            ca_pem=pem,
            durable_id=durable_id,
            timeout_secs=_int("timeout_secs", timeout_secs),
            redundancy=_int("redundancy", redundancy, 0, 2),
            reconnect=_bool("reconnect", reconnect),
            reconnect_max_secs=_number("reconnect_max_secs", reconnect_max_secs),
            reconnect_delay_initial_ms=_int("reconnect_delay_initial_ms",
                                            reconnect_delay_initial_ms),
            reconnect_delay_max_ms=_int("reconnect_delay_max_ms", reconnect_delay_max_ms),
            reconnect_attempt_timeout_ms=_int("reconnect_attempt_timeout_ms",
                                              reconnect_attempt_timeout_ms, 1),
            ack_mode=ack_mode,
            checkpoint=_opt_int("checkpoint", checkpoint),
            server_name=_opt_str("server_name", server_name),
            token=_opt_str("token", token),
            cert_file=_path("cert_file", cert_file),
            key_file=_path("key_file", key_file),
            failure_timeout_ms=_opt_int("failure_timeout_ms", failure_timeout_ms, 300, 600_000),
            ack_interval_ms=_int("ack_interval_ms", ack_interval_ms, 1),
            name=_str("name", name),
            batch_size=_int("batch_size", batch_size, 1, 1_000_000),
            replay_rate=_int("replay_rate", replay_rate, 0),
        )
        self.durable_id = durable_id
        self.ack_mode = ack_mode
        self._initial: list[tuple[str, str, bytes | None]] | None = None

    @classmethod
    async def open(cls, *args: Any, **kwargs: Any) -> Subscriber:
        """Connects in a worker thread (for asyncio): ``sub = await Subscriber.open(...)``."""
        return await asyncio.to_thread(cls, *args, **kwargs)

    # -- state ---------------------------------------------------------------------------------

    @property
    def queue_status(self) -> Literal["new", "expired", "resumed", "none"]:
        """The queue status of the current session: ``new``, ``expired`` or ``resumed`` for a
        durable client, ``none`` otherwise (updated when a :class:`Reconnected` is yielded)."""
        return self._native.queue_status

    @property
    def pending(self) -> int | None:
        """Events that were waiting in the resumed queue (None unless ``resumed``)."""
        return self._native.pending

    @property
    def reconnects(self) -> int:
        """Sessions opened after the first (Reconnected events yielded so far)."""
        return self._native.reconnects

    @property
    def initial(self) -> list[tuple[str, str, bytes | None]]:
        """The initial image of the first registration: (region, key, value) tuples."""
        if self._initial is None:
            self._initial = self._native.take_initial()
        return self._initial

    @property
    def finished(self) -> bool:
        """True once nothing more will be yielded (closed, or ended and drained)."""
        return self._native.finished

    # -- iteration -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[ClientEvent]:
        return self._native

    def __next__(self) -> ClientEvent:
        return next(self._native)

    def next(self, timeout: float | None = None) -> ClientEvent | None:
        """The next event, waiting at most ``timeout`` seconds (None: as long as it takes);
        None on a timeout or once finished. Raises TetherError if the subscription ended by
        itself."""
        return self._native.poll(None if timeout is None else _number("timeout", timeout))

    def next_batch(self, max_events: int = 256,
                   timeout: float | None = None) -> list[ClientEvent]:
        """Up to ``max_events`` items at once, in order: the first waited for as ``next``
        waits (at most ``timeout`` seconds; None: as long as it takes), then those already
        received, without waiting. An empty list on a timeout or once finished; raises
        TetherError if the subscription ended by itself before any. Fewer Python calls per
        event than iterating; with ``ack_mode="auto"`` the whole batch counts as processed
        once more is asked for (or at ``commit`` or ``close``)."""
        return self._native.poll_batch(
            _int("max_events", max_events, lo=1, hi=_BATCH_EVENTS_MAX),
            None if timeout is None else _number("timeout", timeout))

    async def anext_batch(self, max_events: int = 256) -> list[ClientEvent]:
        """:meth:`next_batch` for asyncio: up to ``max_events`` items, in order, once at least
        one is there, waited for without blocking the event loop; an empty list once finished.
        Raises TetherError if the subscription ended by itself before any."""
        most = _int("max_events", max_events, lo=1, hi=_BATCH_EVENTS_MAX)
        return await self._ready(lambda n: n.poll_batch(most, 0.0) or None) or []

    def __aiter__(self) -> AsyncIterator[ClientEvent]:
        return self

    async def __anext__(self) -> ClientEvent:
        ev = await self._ready(lambda n: n.poll(0.0))
        if ev is None:
            raise StopAsyncIteration
        return ev

    async def _ready(self, take: Any) -> Any:
        """What ``take(native)`` returns once it is not None (it must not wait); None once
        finished. Between tries it waits in a worker thread."""
        n = self._native
        while True:
            got = take(n)
            if got is not None:
                return got
            if n.finished:
                return None
            # The wait releases the GIL and returns within half a second, so the event loop
            # is never blocked and a cancelled task leaves no wait behind for long.
            await asyncio.to_thread(n.wait, 0.5)

    def events(self) -> AsyncIterator[ClientEvent]:
        """``async for ev in sub.events()``: the same as ``async for ev in sub``."""
        return self

    # -- acks ----------------------------------------------------------------------------------

    def ack(self, offset: int) -> int:
        """``ack_mode="manual"``: the event at ``offset`` is processed. Acks may come in any
        order; returns the offset everything is processed through (the checkpoint to keep
        with the application's data). Raises UsageError for an offset never delivered, or in
        auto mode."""
        return self._native.ack(_int("offset", offset))

    def commit(self) -> None:
        """``ack_mode="auto"``: the event yielded last (or the batch ``next_batch`` returned
        last) counts as processed now, without waiting for more to be asked for."""
        self._native.commit()

    # -- closing -------------------------------------------------------------------------------

    def close(self, keepalive: bool = True) -> None:
        """Acks what was processed, then closes the session. ``keepalive``: a durable queue
        (and its durable interest) is kept for its timeout; False destroys it. Raises
        ClosedError while not connected (a durable queue then stays until its timeout), unless
        that end was already raised by the iteration. Closing twice does nothing."""
        if self._native is not None:
            self._native.close(_bool("keepalive", keepalive))

    async def aclose(self, keepalive: bool = True) -> None:
        """:meth:`close` in a worker thread (for asyncio)."""
        await asyncio.to_thread(self.close, keepalive)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Subscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        if self._native is None:
            return "<tether.Subscriber (not connected)>"
        return (f"<tether.Subscriber durable_id={self.durable_id!r} "
                f"queue_status={self.queue_status!r} finished={self.finished}>")


# ---------------------------------------------------------------------------------------------
# Publisher


class Publisher:
    """A plain client that publishes and reads values. Methods block (the GIL released) until
    the server answered; under asyncio run them with ``asyncio.to_thread``. When its server
    stops (a rolling restart), the server answers what it did not apply with ``going-away``,
    and the publisher sends it through the next of its ``servers``: no error, no duplicate."""

    def __init__(
        self,
        servers: str | Iterable[str] = (DEFAULT_SERVER,),
        *,
        ca_file: str | os.PathLike[str] | None = None,
        ca_pem: bytes | str | None = None,
        server_name: str | None = None,
        token: str | None = None,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
        failure_timeout_ms: int | None = None,
        ack: Literal["local", "replicated"] = "local",
        name: str = "tether-python",
    ) -> None:
        self._native: Any = None
        ca_path, pem = _ca(ca_file, ca_pem)
        self._ack = self._ack_mode(ack)
        self._native = _native.connect_publisher(
            _servers(servers),
            ca_file=ca_path,
            ca_pem=pem,
            server_name=_opt_str("server_name", server_name),
            token=_opt_str("token", token),
            cert_file=_path("cert_file", cert_file),
            key_file=_path("key_file", key_file),
            failure_timeout_ms=_opt_int("failure_timeout_ms", failure_timeout_ms, 300, 600_000),
            name=_str("name", name),
        )

    @staticmethod
    def _ack_mode(ack: object) -> str:
        if _str("ack", ack) not in ("local", "replicated"):
            raise ValueError(f"ack: expected 'local' or 'replicated', got {ack!r}")
        return ack  # type: ignore[return-value]

    @classmethod
    async def open(cls, *args: Any, **kwargs: Any) -> Publisher:
        """Connects in a worker thread (for asyncio)."""
        return await asyncio.to_thread(cls, *args, **kwargs)

    def put(self, region: str, key: str, value: bytes | str) -> None:
        """Creates or updates a key (a str value is sent as UTF-8)."""
        self._native.publish(
            [("put", _str("region", region), _str("key", key), _bytes("value", value))],
            self._ack,
        )

    def destroy(self, region: str, key: str) -> None:
        """Removes a key."""
        self._native.publish([("destroy", _str("region", region), _str("key", key))],
                             self._ack)

    def invalidate(self, region: str, key: str) -> None:
        """Invalidates a key: it stays, without a value."""
        self._native.publish([("invalidate", _str("region", region), _str("key", key))],
                             self._ack)

    def publish(self, ops: Iterable[tuple[Any, ...]], ack: str | None = None) -> int:
        """Publishes several operations in one request, in order, atomically: each a tuple
        ``("put", region, key, value)``, ``("destroy", region, key)`` or
        ``("invalidate", region, key)``. Returns how many the server committed."""
        if isinstance(ops, (str, bytes)) or not isinstance(ops, Iterable):
            raise TypeError(f"ops: expected a list of tuples, got {_type_name(ops)}")
        wire = []
        for i, op in enumerate(ops):
            if not isinstance(op, tuple) or not op:
                raise TypeError(f"ops[{i}]: expected a tuple, got {_type_name(op)}")
            kind = _str(f"ops[{i}][0]", op[0])
            if kind == "put" and len(op) == 4:
                wire.append(("put", _str(f"ops[{i}] region", op[1]),
                             _str(f"ops[{i}] key", op[2]), _bytes(f"ops[{i}] value", op[3])))
            elif kind in ("destroy", "invalidate") and len(op) == 3:
                wire.append((kind, _str(f"ops[{i}] region", op[1]),
                             _str(f"ops[{i}] key", op[2])))
            else:
                raise ValueError(
                    f"ops[{i}]: expected ('put', region, key, value), ('destroy', region, key) "
                    f"or ('invalidate', region, key), got {op!r}"
                )
        return self._native.publish(wire, self._ack if ack is None else self._ack_mode(ack))

    def get(self, region: str, key: str) -> bytes | None:
        """The current value of a key; None when absent or invalidated."""
        return self._native.get(_str("region", region), _str("key", key))

    def close_durable(self, durable_id: str) -> None:
        """Admin: destroys an away durable client's queue (refused while it is connected)."""
        self._native.close_durable(_str("durable_id", durable_id))

    @property
    def server(self) -> str:
        """The address of the server this publisher is connected to."""
        return self._native.server

    @property
    def moves(self) -> int:
        """How many times the publisher moved to another server."""
        return self._native.moves

    def close(self) -> None:
        """Closes the connection. Closing twice does nothing."""
        if self._native is not None:
            self._native.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<tether.Publisher>"
