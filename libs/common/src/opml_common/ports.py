"""Free ports that stay reserved until their server binds them.

A port picked with a bind to port 0 and released at once can go to any other process (another
test's bind(0), an outgoing connection) in the seconds before the server meant for it starts
(a service importing its dependencies, TensorFlow building a cluster). A held port is bound,
never listening, with SO_REUSEADDR: the kernel gives it to no bind(0) and no connect, and refuses
a plain bind to it, while the intended server, which binds with SO_REUSEADDR as gRPC, asyncio,
http.server, Go's and Rust's listeners and redis-server all do, binds over it.
"""

from __future__ import annotations

import socket


def hold_free_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket holding a free TCP port on ``host`` (``getsockname()[1]``) until it is closed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock
