"""The shape of every service's ``opml <noun>`` command group: where the service is, who is calling.

``service_group`` makes a click group with ``--target`` (env ``OPML_<SERVICE>_TARGET``),
``--token`` (env ``OPML_TOKEN``) and ``--tls-ca`` (env ``OPML_GRPC_TLS_CA``: connect with TLS, checking
the server against this CA; ``OPML_GRPC_TLS_CLIENT_CERT``/``_KEY`` add a client certificate) and puts a :class:`ClientSession` in the context; commands take it
with :data:`pass_session` and open the service's client with ``session.client()``. Domain errors a
command raises are printed as one line by the ``opml`` command itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from opml_common.config import GrpcTlsSettings
from opml_common.grpc.client import ServiceClient


class ClientSession:
    """The target and token the group was given, and the service's client class."""

    def __init__(self, client_class: type[ServiceClient], target: str, token: str | None,
                 options: dict[str, Any], tls_ca: Path | None = None) -> None:
        self.client_class, self.target, self.token = client_class, target, token
        self.options = options  # the group's own extra options, by parameter name
        self.tls_ca = tls_ca

    def client(self) -> Any:
        """A new client of the service (close it, or use it in ``with``)."""
        tls = GrpcTlsSettings(grpc_tls_ca=self.tls_ca) if self.tls_ca is not None else None  # None: env
        return self.client_class(self.target, token=self.token, tls=tls)


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
        def callback(target: str, token: str | None, tls_ca: Path | None, **extra: Any) -> None:
            click.get_current_context().obj = ClientSession(client, target, token, extra, tls_ca)

        callback.__doc__ = function.__doc__
        command: Callable = callback
        for option in reversed(options):
            command = option(command)
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
