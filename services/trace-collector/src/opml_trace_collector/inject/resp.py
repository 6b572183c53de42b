"""The control poll's Redis client: one command (MGET) over one blocking connection, standard library only.

redis-py costs ~36 ms of CPU to import (its package imports every command module), a tenth of what
a short traced job may spend on the tracer in all, for a poll that reads two keys. This client speaks
the few lines of RESP2 that MGET needs, on ``redis://``, ``rediss://`` (TLS with the system's CAs and
hostname check) and ``unix://`` URLs with a user, a password and a database (from the URL's path or
its ``db``/``password`` parameters). A URL with any other option makes ``parse_url`` raise
``Unsupported`` and the poller falls back to redis-py, so every URL the platform accepts still works.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import parse_qs, unquote, urlsplit

_MAX_BULK = 1 << 20  # a control value is a few hundred bytes; anything larger is not ours
_MAX_LINE = 1 << 16


class Unsupported(ValueError):
    """A URL option this client does not implement (redis-py is used instead)."""


class ReplyError(Exception):
    """Redis answered with an error (``-ERR ...``), or with something MGET never returns."""


@dataclass(frozen=True)
class Endpoint:
    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None  # a unix socket
    tls: bool = False
    username: str | None = None
    password: str | None = None
    db: int = 0


def parse_url(url: str) -> Endpoint:
    """The endpoint of a ``redis://``, ``rediss://`` or ``unix://`` URL.

    Raises:
        Unsupported: another scheme, or a query option other than ``db`` and ``password``.
        ValueError: the port or database is not a number.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise Unsupported(f"scheme {parts.scheme!r}")
    query = parse_qs(parts.query)
    extra = sorted(set(query) - {"db", "password"})
    if extra:
        raise Unsupported(f"URL options {extra}")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    password = query["password"][0] if "password" in query else password
    if parts.scheme == "unix":
        db = query.get("db", ["0"])[0]
        return Endpoint(path=unquote(parts.path), username=username, password=password, db=int(db))
    db = query.get("db", [parts.path.lstrip("/") or "0"])[0]
    return Endpoint(host=parts.hostname or "127.0.0.1", port=parts.port or 6379, tls=parts.scheme == "rediss",
                    username=username, password=password, db=int(db))


def _command(*args: str | bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _reply(reader: BinaryIO) -> object:
    """One RESP2 reply: bytes, None, int, str (a status), or a list of them.

    Raises:
        ReplyError: an error reply, or a malformed or oversized one.
        ConnectionError: the connection closed mid-reply.
    """
    line = reader.readline(_MAX_LINE)
    if not line.endswith(b"\r\n"):
        raise ConnectionError("the connection closed mid-reply") if not line else ReplyError(f"unexpected reply {line[:40]!r}")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body.decode()
    if kind == b"-":
        raise ReplyError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        if size < 0:
            return None
        if size > _MAX_BULK:
            raise ReplyError(f"a {size}-byte value, more than a control key holds")
        data = reader.read(size + 2)
        if len(data) < size + 2:
            raise ConnectionError("the connection closed mid-reply")
        return data[:-2]
    if kind == b"*":
        count = int(body)
        return None if count < 0 else [_reply(reader) for _ in range(count)]
    raise ReplyError(f"unexpected reply {line[:40]!r}")


class RedisReader:
    """MGET on one lazily opened, blocking connection; after any failure the next call reconnects.

    Not safe for concurrent calls (the tracer's thread polls one MGET at a time).
    """

    def __init__(self, endpoint: Endpoint, *, timeout_s: float = 2.0) -> None:
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._socket: socket.socket | None = None
        self._reader: BinaryIO | None = None

    def mget(self, keys: list[str]) -> list[bytes | None]:
        """The values of ``keys`` (None where absent).

        Raises:
            OSError (TimeoutError among them): Redis cannot be reached or did not answer within the timeout.
            ReplyError: Redis refused (authentication, a wrong type) or answered nonsense.
        """
        try:
            if self._socket is None:
                self._connect()
            self._socket.sendall(_command("MGET", *keys))
            values = _reply(self._reader)
        except BaseException:  # a timeout mid-reply leaves the stream unusable
            self.close()
            raise
        if not isinstance(values, list) or len(values) != len(keys):
            self.close()
            raise ReplyError("MGET did not answer one value per key")
        return values

    def _connect(self) -> None:
        e = self._endpoint
        if e.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout_s)
            try:
                sock.connect(e.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((e.host, e.port), timeout=self._timeout_s)
            if e.tls:
                import ssl
                try:
                    sock = ssl.create_default_context().wrap_socket(sock, server_hostname=e.host)
                except BaseException:
                    sock.close()
                    raise
        self._socket, self._reader = sock, sock.makefile("rb")
        setup = []
        if e.password is not None:
            setup.append(_command("AUTH", e.username, e.password) if e.username else _command("AUTH", e.password))
        if e.db:
            setup.append(_command("SELECT", str(e.db)))
        if setup:
            sock.sendall(b"".join(setup))
            for _ in setup:
                _reply(self._reader)  # an -ERR (wrong password, no such db) raises here

    @property
    def sockname(self) -> tuple | None:
        """The local address of the open connection (tests kill it by this), None when closed."""
        return self._socket.getsockname() if self._socket is not None else None

    def close(self) -> None:
        reader, sock, self._reader, self._socket = self._reader, self._socket, None, None
        if reader is not None:
            reader.close()
        if sock is not None:
            sock.close()
