"""Wrong arguments give one clear TypeError or ValueError naming the argument; an address
where nothing listens gives ConnectError quickly."""

from __future__ import annotations

import asyncio
import time

import pytest

import tether
from tether import _native
from conftest import free_port


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"servers": 7400}, TypeError, "servers"),
        ({"servers": ["127.0.0.1:7400", 7401]}, TypeError, "servers[1]"),
        ({"servers": []}, ValueError, "servers"),
        ({"servers": "127.0.0.1"}, ValueError, "servers"),
        ({"interests": {"R": "all"}}, TypeError, "interests['R']"),
        ({"interests": ["R"]}, TypeError, "interests"),
        ({"interests": {"R": [tether.all_keys(), "k"]}}, TypeError, "interests['R'][1]"),
        ({"durable_id": 5}, TypeError, "durable_id"),
        ({"durable_id": ""}, ValueError, "durable_id"),
        ({"timeout_secs": "300"}, TypeError, "timeout_secs"),
        ({"timeout_secs": -1}, ValueError, "timeout_secs"),
        ({"redundancy": 3}, ValueError, "redundancy"),
        ({"reconnect": "yes"}, TypeError, "reconnect"),
        ({"ack_mode": "sometimes"}, ValueError, "ack_mode"),
        ({"checkpoint": 1.5}, TypeError, "checkpoint"),
        ({"ca_file": 3}, TypeError, "ca_file"),
        ({"failure_timeout_ms": 10}, ValueError, "failure_timeout_ms"),
        ({"reconnect_max_secs": -2}, ValueError, "reconnect_max_secs"),
    ],
)
def test_wrong_subscriber_arguments_name_the_argument(server, kwargs, error, words):
    kwargs = {"servers": [server.addr], "ca_file": server.ca, **kwargs}
    servers = kwargs.pop("servers")
    with pytest.raises(error) as e:
        tether.Subscriber(servers, **kwargs)
    assert words in str(e.value)


def test_wrong_interest_and_publisher_arguments(server):
    with pytest.raises(TypeError, match="key: expected str, got int"):
        tether.key(5)
    with pytest.raises(TypeError, match="keys: expected a list of str"):
        tether.keys("abc")
    with pytest.raises(ValueError, match="policy"):
        tether.all_keys(policy="everything")
    with pytest.raises(TypeError, match="durable"):
        tether.regex("x", durable="yes")
    with server.publisher() as pub:
        with pytest.raises(TypeError, match="value: expected bytes or str, got int"):
            pub.put("R", "k", 5)
        with pytest.raises(TypeError, match="region: expected str, got NoneType"):
            pub.get(None, "k")
        with pytest.raises(ValueError, match=r"ops\[0\]"):
            pub.publish([("upsert", "R", "k", b"v")])
        with pytest.raises(TypeError, match=r"ops\[1\]"):
            pub.publish([("destroy", "R", "k"), "destroy R k"])
        with pytest.raises(ValueError, match="ack"):
            pub.publish([], ack="eventually")
    with server.subscriber(durable_id="b1", ack_mode="manual") as sub:
        with pytest.raises(TypeError, match="offset: expected int, got str"):
            sub.ack("3")
        with pytest.raises(TypeError, match="timeout"):
            sub.next("soon")
        with pytest.raises(ValueError, match="max_events: 0 is outside 1"):
            sub.next_batch(0)
        with pytest.raises(TypeError, match="max_events: expected int, got str"):
            sub.next_batch("3")
        with pytest.raises(TypeError, match="timeout"):
            sub.next_batch(3, timeout="soon")
        with pytest.raises(ValueError, match="max_events: 0 is outside 1"):
            asyncio.run(sub.anext_batch(0))
        with pytest.raises(TypeError, match="keepalive"):
            sub.close(keepalive="no")


def test_the_native_layer_names_the_argument_too(server):
    with pytest.raises(TypeError, match="servers"):
        _native.subscribe(5, interests=[])
    with pytest.raises(TypeError, match="timeout_secs"):
        _native.subscribe([server.addr], interests=[], ca_file=server.ca, timeout_secs="x")
    with pytest.raises(ValueError, match="ack_mode"):
        _native.subscribe([server.addr], interests=[], ca_file=server.ca, ack_mode="x")
    with pytest.raises(ValueError, match="interests"):
        _native.subscribe([server.addr], ca_file=server.ca,
                          interests=[("R", "glob", ["*"], None, "keys-values", True)])


def test_server_refusals_carry_the_client_library_message(server):
    with pytest.raises(tether.TetherError, match="checkpoint 50 is beyond the end"):
        with server.subscriber(durable_id="c1", interests={"R": tether.all_keys()}):
            pass
        server.subscriber(durable_id="c1", checkpoint=50)
    with pytest.raises(tether.ServerError) as e:
        server.subscriber(interests={"R": tether.regex("(unclosed")})
    assert e.value.code and "regex" in str(e.value).lower()


def test_nothing_listening_raises_connect_error_quickly(server):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(tether.ConnectError, match=f"cannot reach any server .*:{port}"):
        tether.Subscriber([f"127.0.0.1:{port}"], ca_file=server.ca, durable_id="x",
                          failure_timeout_ms=1000)
    assert time.monotonic() - t0 < 5
    with pytest.raises(tether.ConnectError):
        tether.Publisher([f"127.0.0.1:{port}"], ca_file=server.ca, failure_timeout_ms=1000)
    with pytest.raises(tether.TlsError):
        tether.Publisher([server.addr], ca_file="/nonexistent/ca.pem")
