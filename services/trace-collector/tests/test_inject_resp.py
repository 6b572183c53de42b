"""The control poll's own Redis client (``inject.resp``) against the real Redis, and what the tracer's
set-up imports: neither redis-py nor prometheus_client (their CPU was most of a short job's tracer cost)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import redis

from opml_trace_collector.inject import resp
from opml_trace_collector.inject.control import redis_client


def test_urls_the_platform_accepts_are_parsed_like_redis_py() -> None:
    assert resp.parse_url("redis://127.0.0.1:6380/3") == resp.Endpoint(port=6380, db=3)
    assert resp.parse_url("redis://u%40x:p%3Aw@cache:7000") == resp.Endpoint(host="cache", port=7000,
                                                                               username="u@x", password="p:w")
    assert resp.parse_url("redis://:secret@h/1") == resp.Endpoint(host="h", password="secret", db=1)
    assert resp.parse_url("redis://h?db=2&password=pw") == resp.Endpoint(host="h", password="pw", db=2)
    assert resp.parse_url("rediss://h:6390/0").tls
    assert resp.parse_url("unix:///run/redis.sock?db=4") == resp.Endpoint(path="/run/redis.sock", db=4)
    with pytest.raises(resp.Unsupported, match="ssl_cert_reqs"):
        resp.parse_url("rediss://h?ssl_cert_reqs=none")
    with pytest.raises(resp.Unsupported):
        resp.parse_url("http://h")
    with pytest.raises(ValueError):
        resp.parse_url("redis://h/notanumber")


def test_a_url_option_it_does_not_implement_falls_back_to_redis_py() -> None:
    assert isinstance(redis_client("redis://127.0.0.1:6379/0"), resp.RedisReader)
    assert isinstance(redis_client("redis://127.0.0.1:6379/0?socket_keepalive=true"), redis.Redis)


@pytest.fixture
def real(settings_env: dict[str, str]) -> Iterator[tuple[redis.Redis, str, str]]:
    """redis-py on the machine's Redis (to write what the reader reads), the URL and a key prefix."""
    url, prefix = settings_env["OPML_REDIS_URL"], settings_env["OPML_REDIS_PREFIX"] + "resp:"
    client = redis.Redis.from_url(url)
    yield client, url, prefix
    endpoint = resp.parse_url(url)
    db1 = redis.Redis(host=endpoint.host, port=endpoint.port, db=1)
    for each in (client, db1):
        keys = each.keys(prefix + "*")
        if keys:
            each.delete(*keys)
        each.close()


def test_mget_reads_values_and_absent_keys(real) -> None:  # noqa: ANN001
    client, url, prefix = real
    client.set(prefix + "a", "0")
    client.set(prefix + "b", json.dumps({"capture_id": "x", "steps": 3}))
    client.set(prefix + "bin", b"\x00\r\n\xff")
    reader = resp.RedisReader(resp.parse_url(url))
    try:
        assert reader.mget([prefix + "a", prefix + "b", prefix + "none", prefix + "bin"]) == [
            b"0", b'{"capture_id": "x", "steps": 3}', None, b"\x00\r\n\xff"]
        assert reader.mget([prefix + "a"]) == [b"0"], "the connection is reused"
    finally:
        reader.close()


def test_the_database_of_the_url_is_selected(real) -> None:  # noqa: ANN001
    client, url, prefix = real
    endpoint = resp.parse_url(url)
    db1 = redis.Redis(host=endpoint.host, port=endpoint.port, db=1)
    db1.set(prefix + "k", "in-db-1")
    db1.close()
    reader = resp.RedisReader(resp.Endpoint(host=endpoint.host, port=endpoint.port, db=1))
    try:
        assert reader.mget([prefix + "k"]) == [b"in-db-1"]
    finally:
        reader.close()


def test_a_refused_password_is_an_error_without_the_password(real) -> None:  # noqa: ANN001
    _client, url, prefix = real
    endpoint = resp.parse_url(url)
    reader = resp.RedisReader(resp.Endpoint(host=endpoint.host, port=endpoint.port, password="hunter2-secret"))
    with pytest.raises(resp.ReplyError) as refused:
        reader.mget([prefix + "a"])
    assert "AUTH" in str(refused.value) or "WRONGPASS" in str(refused.value) or "password" in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_a_killed_connection_fails_one_call_and_the_next_reconnects(real) -> None:  # noqa: ANN001
    client, url, prefix = real
    client.set(prefix + "a", "1")
    reader = resp.RedisReader(resp.parse_url(url))
    try:
        assert reader.mget([prefix + "a"]) == [b"1"]
        host, port = reader.sockname[:2]
        assert client.execute_command("CLIENT", "KILL", "ADDR", f"{host}:{port}")
        with pytest.raises(OSError):
            reader.mget([prefix + "a"])
        assert reader.mget([prefix + "a"]) == [b"1"]
    finally:
        reader.close()


def test_a_value_larger_than_a_control_key_is_refused(real) -> None:  # noqa: ANN001
    client, url, prefix = real
    client.set(prefix + "big", b"x" * (resp._MAX_BULK + 1))
    reader = resp.RedisReader(resp.parse_url(url))
    try:
        with pytest.raises(resp.ReplyError, match="more than a control key"):
            reader.mget([prefix + "big"])
    finally:
        reader.close()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP listener that accepts and never answers: a hung Redis."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for connection in held:
        connection.close()


def test_a_redis_that_never_answers_times_out(silent_server: int) -> None:
    reader = resp.RedisReader(resp.Endpoint(port=silent_server), timeout_s=0.2)
    with pytest.raises(TimeoutError):
        reader.mget(["k"])
    assert reader.sockname is None, "the half-read connection is dropped"


def test_the_tracers_setup_imports_no_pydantic_broker_client_or_redis_py() -> None:
    """What ``Tracer._setup`` and its batches import on the tracer's thread (TensorFlow aside): the
    standard library, protobuf and our own modules; the broker is the shipper's business."""
    code = ("import json, sys\n"
            "from opml_trace_collector.inject import config, spool, tracer\n"
            "from opml_trace_collector.inject.control import ControlPoller\n"
            "from opml_trace_collector.inject.spool import RunSpool\n"
            "from opml_trace_collector_contract.topics import TRACES, tracer_source\n"
            "from opml_trace_collector.session import record_to_line\n"
            "from opml.traces.v1 import events_pb2\n"
            "config.read()\n"
            "heavy = ('pydantic', 'pydantic_settings', 'aiokafka', 'opml_common.bus.producer', 'opml_common.config',\n"
            "         'redis', 'prometheus_client', 'minio', 'opml_common.metrics', 'opml_common.bus.consumer',\n"
            "         'opml_common.bus.admin')\n"
            "print(json.dumps([m for m in heavy if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
