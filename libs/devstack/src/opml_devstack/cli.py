"""The development stack's ``opml`` commands, added through the ``opml.cli`` entry point group as the
services add theirs: ``opml infra up`` (the embedded infrastructure in the foreground) and
``opml status`` (every part of the ``make up`` stack).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click


@click.group()
def infra() -> None:
    """The embedded infrastructure (tansu broker, SeaweedFS S3, Redis) for development."""


@infra.command("up")
@click.option("--dir", "workdir", type=click.Path(path_type=Path), default=Path(".opml/infra"), show_default=True,
              help="Where data and logs go.")
@click.option("--kafka-port", default=9092, show_default=True, help="0 picks a free port.")
@click.option("--s3-port", default=8333, show_default=True, help="0 picks a free port.")
def infra_up(workdir: Path, kafka_port: int, s3_port: int) -> None:
    """Start the infrastructure in the foreground; Ctrl-C stops it."""
    from opml_common.grpc.server import wait_for_signal
    from opml_devstack.devinfra import DevInfra

    with DevInfra(workdir=workdir, kafka_port=kafka_port, s3_port=s3_port) as endpoints:
        for key, value in endpoints.env().items():
            click.echo(f"export {key}={value}")
        asyncio.run(wait_for_signal())


def find_state_dir(start: Path) -> tuple[Path | None, list[Path]]:
    """The `make up` state directory of the checkout that holds ``start``, and the folders looked in.

    `make up` keeps the stack's state in ``.opml/`` at the checkout's root, so ``opml status`` run in
    any folder of the checkout looks from there upward, through the checkout's root (the folder with
    ``.git``) and no further: a stack of another checkout above this one is not this checkout's.
    """
    looked: list[Path] = []
    for folder in (start, *start.parents):
        looked.append(folder)
        if (folder / ".opml" / "stack.json").is_file():
            return folder / ".opml", looked
        if (folder / ".git").exists():
            break
    return None, looked


@click.command("status")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="The state directory of the stack (default: the .opml of `make up`, looked for from "
                   "this folder up to the checkout's root).")
@click.option("--json", "as_json", is_flag=True, help="The state as JSON, for scripts.")
def status(state_dir: Path | None, as_json: bool) -> None:
    """Every part of the `make up` stack: state, health (checked now), pid, restarts, ports, version, log.

    Exits 1 when the stack is not running, a part is FAILED, or a part is not healthy.
    """
    import json

    from opml_devstack.stack import status as stack_status

    if state_dir is None:
        state_dir, looked = find_state_dir(Path.cwd().resolve())
        if state_dir is None:
            message = (f"the stack is not running: no .opml/stack.json in {looked[0]} nor any folder above it up to "
                       f"{looked[-1]}; `make up` at the checkout's root starts it")
            if as_json:
                click.echo(json.dumps({"running": False, "ok": False, "parts": [], "message": message,
                                       "looked_in": [str(folder) for folder in looked]}, indent=2))
            else:
                click.echo(message, err=True)
            sys.exit(1)
    document = stack_status(state_dir)
    if as_json:
        click.echo(json.dumps(document, indent=2))
        sys.exit(0 if document["ok"] else 1)
    from rich.table import Table

    from opml_common.cligroup import output_console

    console = output_console()
    if document.get("message"):
        console.print(document["message"])
    if document["parts"]:
        table = Table(title=f"stack {document.get('pid')} (broker storage {document.get('kafka_storage')})")
        for column in ("part", "kind", "state", "health", "pid", "restarts", "ports", "version", "log"):
            table.add_column(column, no_wrap=column in ("part", "state", "health"))
        good = {"RUNNING", "SERVING", "UP"}
        for part in document["parts"]:
            state, health = part["state"], part["health"]
            exit_code = f" (exit {part['last_exit_code']})" if part.get("last_exit_code") is not None else ""
            table.add_row(
                part["name"], part["kind"],
                f"[{'green' if state in good else 'red'}]{state}[/]{exit_code}",
                f"[{'green' if health in good else 'red'}]{health}[/]",
                str(part.get("pid") or "-"), str(part["restarts"]),
                " ".join(f"{name}:{port}" for name, port in part.get("ports", {}).items()),
                part.get("version", ""), part.get("log_path", ""))
        console.print(table)
    sys.exit(0 if document["ok"] else 1)
