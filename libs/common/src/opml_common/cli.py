"""The ``opml`` command. Services add their subcommands through the ``opml.cli`` entry point group
(bundle-store adds ``opml bundle``), so the CLI grows with the installed packages: the development
stack (opml-devstack, not in production images) adds ``opml infra`` and ``opml status`` the same way.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

import click

from opml_common.errors import OpmlError


class _OpmlGroup(click.Group):
    """Prints a platform error as one actionable line (``NOT_FOUND: ...``), an INVALID_ARGUMENT with
    several violations as one line per field, and exits 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OpmlError as error:
            violations = getattr(error, "violations", ())
            if len(violations) > 1:  # an InvalidArgument with several broken rules: one line each
                for field, rule in violations:
                    click.echo(f"error: {error.code}: {field}: {rule}", err=True)
            else:
                click.echo(f"error: {error.code}: {error.message}", err=True)
            sys.exit(1)


@click.group(cls=_OpmlGroup)
@click.version_option(package_name="opml-common")
def main() -> None:
    """OpML platform: bundles, jobs, experiments, serving, monitoring, federated learning."""


def _load_plugins() -> None:
    for entry in entry_points(group="opml.cli"):
        main.add_command(entry.load(), entry.name)


_load_plugins()
