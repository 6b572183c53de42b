"""The ``opml`` command. Services add their subcommands through the ``opml.cli`` entry point group
(bundle-store adds ``opml bundle``), so the CLI grows with the installed services.
"""

from __future__ import annotations

import asyncio
import sys
from importlib.metadata import entry_points
from pathlib import Path

import click

from opml_common.errors import OpmlError


class _OpmlGroup(click.Group):
    """Prints a platform error as one actionable line (``NOT_FOUND: ...``) and exits 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OpmlError as error:
            click.echo(f"error: {error.code}: {error.message}", err=True)
            sys.exit(1)


@click.group(cls=_OpmlGroup)
@click.version_option(package_name="opml-common")
def main() -> None:
    """OpML platform: bundles, jobs, experiments, serving, monitoring, federated learning."""


@main.group()
def infra() -> None:
    """The embedded infrastructure (tansu broker, SeaweedFS S3, Redis) for development."""


@infra.command("up")
@click.option("--dir", "workdir", type=click.Path(path_type=Path), default=Path(".opml/infra"), show_default=True,
              help="Where data and logs go.")
@click.option("--kafka-port", default=9092, show_default=True, help="0 picks a free port.")
@click.option("--s3-port", default=8333, show_default=True, help="0 picks a free port.")
def infra_up(workdir: Path, kafka_port: int, s3_port: int) -> None:
    """Start the infrastructure in the foreground; Ctrl-C stops it."""
    from opml_common.devinfra import DevInfra
    from opml_common.grpc.server import wait_for_signal

    with DevInfra(workdir=workdir, kafka_port=kafka_port, s3_port=s3_port) as endpoints:
        for key, value in endpoints.env().items():
            click.echo(f"export {key}={value}")
        asyncio.run(wait_for_signal())


def _load_plugins() -> None:
    for entry in entry_points(group="opml.cli"):
        main.add_command(entry.load(), entry.name)


_load_plugins()
