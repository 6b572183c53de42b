"""The shape of every service's ``opml <noun>`` command group: where the service is, who is calling.

``service_group`` makes a click group with ``--target`` (env ``OPML_<SERVICE>_TARGET``),
``--token`` (env ``OPML_TOKEN``) and ``--tls-ca`` (env ``OPML_GRPC_TLS_CA``: connect with TLS, checking
the server against this CA; ``OPML_GRPC_TLS_CLIENT_CERT``/``_KEY`` add a client certificate) and puts a :class:`ClientSession` in the context; commands take it
with :data:`pass_session` and open the service's client with ``session.client()``. Domain errors a
command raises are printed as one line by the ``opml`` command itself.

A command that watches (a server stream, or a refresh loop) reads through :meth:`ClientSession.follow`,
which reconnects when the service restarts: each watcher resumes from what it has shown, and gives up
only after ``--reconnect-s`` (env ``OPML_RECONNECT_S``) of being unable to reach the service.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console

from opml_common.config import GrpcTlsSettings
from opml_common.errors import DeadlineExceeded, Unavailable
from opml_common.grpc.client import ServiceClient
from opml_common.retry import Backoff

T = TypeVar("T")

RECONNECT_S = 60.0
"""How long a watcher goes on trying to reach its restarting service, by default (``--reconnect-s``)."""
RECONNECT_BACKOFF = Backoff(base_s=0.2, max_s=5.0)


class ClientSession:
    """The target and token the group was given, and the service's client class."""

    def __init__(self, client_class: type[ServiceClient], target: str, token: str | None,
                 options: dict[str, Any], tls_ca: Path | None = None, reconnect_s: float = RECONNECT_S) -> None:
        self.client_class, self.target, self.token = client_class, target, token
        self.options = options  # the group's own extra options, by parameter name
        self.tls_ca = tls_ca
        self.reconnect_s = reconnect_s

    def client(self) -> Any:
        """A new client of the service (close it, or use it in ``with``)."""
        tls = GrpcTlsSettings(grpc_tls_ca=self.tls_ca) if self.tls_ca is not None else None  # None: env
        return self.client_class(self.target, token=self.token, tls=tls)

    def follow(self, read: Callable[[Any], Iterable[T]]) -> Iterator[T]:
        """What ``read(client)`` yields, across restarts of the service.

        When the service cannot be reached or does not answer in time (it is restarting), says "reconnecting..." on
        stderr, waits (:data:`RECONNECT_BACKOFF`) and calls ``read`` again with a new client; ``read``
        resumes from what the caller has shown (its own state: a round number, a byte count). Each item
        read resets the wait. After ``reconnect_s`` seconds without reaching the service it gives up.

        Raises:
            Unavailable: the service stayed unreachable for ``reconnect_s`` seconds.
        """
        retry, down_since = 0, None
        while True:
            try:
                with self.client() as client:
                    for item in read(client):
                        retry, down_since = 0, None
                        yield item
                return
            except (Unavailable, DeadlineExceeded) as error:
                now = time.monotonic()
                down_since = down_since if down_since is not None else now
                if now - down_since >= self.reconnect_s:
                    raise Unavailable(f"{self.target} stayed unreachable for {self.reconnect_s:g} s, gave up "
                                      f"(--reconnect-s): {error.message}") from None
                delay = RECONNECT_BACKOFF.delay(retry)
                retry += 1
                click.echo(f"reconnecting to {self.target} in {delay:.1f} s ({error.message})...", err=True)
                time.sleep(delay)


pass_session = click.make_pass_decorator(ClientSession)

PIPE_WIDTH = 200


def output_console() -> Console:
    """Where a command prints: the terminal's width on a terminal; whole lines (``PIPE_WIDTH`` columns)
    into a pipe or file, so ``opml ... | grep`` sees no cell cut short, whatever ``COLUMNS`` said."""
    return Console(width=None if sys.stdout.isatty() else PIPE_WIDTH)


def service_group(name: str, *, service: str, client: type[ServiceClient], default_target: str,
                  options: tuple[Callable[[Callable], Callable], ...] = ()) -> Callable[[Callable], click.Group]:
    """Decorate a function (its docstring is the group's help) into the ``opml <name>`` group of
    ``service``. ``options`` are extra click options of the group, kept in ``session.options``."""
    env = "OPML_" + service.upper().replace("-", "_") + "_TARGET"

    def decorate(function: Callable) -> click.Group:
        def callback(target: str, token: str | None, tls_ca: Path | None, reconnect_s: float, **extra: Any) -> None:
            click.get_current_context().obj = ClientSession(client, target, token, extra, tls_ca, reconnect_s)

        callback.__doc__ = function.__doc__
        command: Callable = callback
        for option in reversed(options):
            command = option(command)
        command = click.option("--reconnect-s", envvar="OPML_RECONNECT_S", default=RECONNECT_S, show_default=True,
                               type=click.FloatRange(min=0),
                               help="How long a watching command goes on reconnecting to a restarting service "
                                    "before it gives up (env OPML_RECONNECT_S).")(command)
        command = click.option("--tls-ca", envvar="OPML_GRPC_TLS_CA", default=None,
                               type=click.Path(exists=True, dir_okay=False, path_type=Path),
                               help="Connect with TLS, checking the server's certificate against this "
                               "PEM CA (env OPML_GRPC_TLS_CA).")(command)
        command = click.option("--token", envvar="OPML_TOKEN", default=None,
                               help="Bearer token (env OPML_TOKEN).")(command)
        command = click.option("--target", envvar=env, default=default_target, show_default=True,
                               help=f"{service} gRPC address (env {env}).")(command)
        return click.group(name)(command)

    return decorate
