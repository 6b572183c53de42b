"""The control poll's Redis client: one command (MGET) over one asyncio connection, standard library only.

redis-py costs ~36 ms of CPU to import (its package imports every command module), a tenth of what
a short traced job may spend on the tracer in all, for a poll that reads two keys. This client speaks
the few lines of RESP2 that MGET needs, on ``redis://``, ``rediss://`` (TLS with the system's CAs and
hostname check) and ``unix://`` URLs with a user, a password and a database (from the URL's path or
its ``db``/``password`` parameters). A URL with any other option makes ``parse_url`` raise
``Unsupported`` and the poller falls back to redis-py, so every URL the platform accepts still works.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

_MAX_BULK = 1 << 20  # a control value is a few hundred bytes; anything larger is not ours


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


async def _reply(reader: asyncio.StreamReader) -> object:
    """One RESP2 reply: bytes, None, int, str (a status), or a list of them.

    Raises:
        ReplyError: an error reply, or a malformed or oversized one.
    """
    line = await reader.readuntil(b"\r\n")
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
        return (await reader.readexactly(size + 2))[:-2]
    if kind == b"*":
        count = int(body)
        return None if count < 0 else [await _reply(reader) for _ in range(count)]
    raise ReplyError(f"unexpected reply {line[:40]!r}")


class RedisReader:
    """MGET on one lazily opened connection; after any failure the next call reconnects.

    Not safe for concurrent calls (the poller awaits one MGET at a time).
    """

    def __init__(self, endpoint: Endpoint, *, timeout_s: float = 2.0) -> None:
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def mget(self, keys: list[str]) -> list[bytes | None]:
        """The values of ``keys`` (None where absent).

        Raises:
            OSError, TimeoutError: Redis cannot be reached or did not answer within the timeout.
            ReplyError: Redis refused (authentication, a wrong type) or answered nonsense.
        """
        try:
            return await asyncio.wait_for(self._mget(keys), self._timeout_s)
        except BaseException:  # a timeout or a cancel mid-reply leaves the stream unusable
            self._drop()
            raise

    async def _mget(self, keys: list[str]) -> list[bytes | None]:
        reader, writer = self._streams or await self._connect()
        writer.write(_command("MGET", *keys))
        await writer.drain()
        values = await _reply(reader)
        if not isinstance(values, list) or len(values) != len(keys):
            raise ReplyError("MGET did not answer one value per key")
        return values

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        e = self._endpoint
        if e.path is not None:
            reader, writer = await asyncio.open_unix_connection(e.path)
        else:
            context = None
            if e.tls:
                import ssl
                context = ssl.create_default_context()
            reader, writer = await asyncio.open_connection(e.host, e.port, ssl=context)
        self._streams = reader, writer
        setup = []
        if e.password is not None:
            setup.append(_command("AUTH", e.username, e.password) if e.username else _command("AUTH", e.password))
        if e.db:
            setup.append(_command("SELECT", str(e.db)))
        if setup:
            writer.write(b"".join(setup))
            await writer.drain()
            for _ in setup:
                await _reply(reader)  # an -ERR (wrong password, no such db) raises here
        return reader, writer

    def _drop(self) -> None:
        streams, self._streams = self._streams, None
        if streams is not None:
            streams[1].close()

    async def aclose(self) -> None:
        streams = self._streams
        self._drop()
        if streams is not None:
            try:
                await streams[1].wait_closed()
            except OSError:
                pass
