"""The platform's Redis client sends a command again only when its connection was closed, never when
it timed out (the command may have run: an INCR or an RPUSH sent again counts twice). Against a
socket server that answers the client's handshake and never the command itself."""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions as redis_errors

from opml_common.config import PlatformSettings
from opml_common.storage import redis_client


class SilentRedis:
    """Answers +OK to every command but INCR, which it counts and never answers."""

    def __init__(self) -> None:
        self.incr = 0
        self.server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                commands = data.count(b"\r\n*") + data.startswith(b"*")  # one RESP array per command
                if b"INCR" in data.upper():
                    self.incr += 1
                    continue
                writer.write(b"+OK\r\n" * commands)
                await writer.drain()
        finally:
            writer.close()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def test_a_command_that_timed_out_is_not_sent_again() -> None:
    silent = SilentRedis()
    async with silent as port:
        client = redis_client(PlatformSettings(redis_url=f"redis://127.0.0.1:{port}/0?socket_timeout=0.2"))
        try:
            with pytest.raises(redis_errors.TimeoutError):
                await client.incr("counter")
        finally:
            await client.aclose()
    assert silent.incr == 1
