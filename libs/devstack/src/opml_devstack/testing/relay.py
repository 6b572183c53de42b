"""A TCP relay for tests: a link between a client and a server that a test can delay, cut and restore.

``listen`` opens a port that forwards each connection to the upstream (an unreachable upstream closes
the client's connection); ``close`` stops listening, so new connections are refused as if the server
were down, while the relay's port stays the endpoint the client was configured with; ``listen`` on
that port again restores the link. With ``delay_s`` every chunk read from one side is written to the
other that much later, in order (latency without reordering; the rate is left to the link).
"""

from __future__ import annotations

import asyncio
import threading


class TcpRelay:
    """Runs on its own thread and event loop; use as a context manager."""

    def __init__(self, upstream: tuple[str, int], delay_s: float = 0.0) -> None:
        self.upstream, self.delay_s = upstream, delay_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tcp-relay", daemon=True)
        self.servers: dict[int, asyncio.Server] = {}

    def listen(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Starts relaying connections to ``host``:``port`` (0: a free one; returned) to the upstream."""
        async def start() -> asyncio.Server:
            return await asyncio.start_server(self._relay, host, port, reuse_address=True)
        server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        port = server.sockets[0].getsockname()[1]
        self.servers[port] = server
        return port

    def close(self, port: int) -> None:
        """Stops listening on ``port`` (connections already relayed go on)."""
        async def stop() -> None:
            server = self.servers.pop(port)
            server.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while chunk := await reader.read(65536):
                if self.delay_s:
                    loop.call_later(self.delay_s, writer.write, chunk)
                else:
                    writer.write(chunk)
                    await writer.drain()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)  # what is in flight arrives before the close
        finally:
            writer.close()

    def __enter__(self) -> TcpRelay:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        async def shut() -> None:
            for server in self.servers.values():
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:  # a relayed connection's own error ends with it: a relay forwards, it does not judge
                await asyncio.wait(tasks)
        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
