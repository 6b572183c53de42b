"""``opml bundle``: Disdat's verbs over the bundle-store API.

The current context (``opml bundle context switch``) is kept in ``$OPML_CLI_HOME/cli.json``
(default ~/.opml), as Disdat keeps its current context per user.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
from google.protobuf.json_format import MessageToDict
from opml.bundles.v1 import bundles_pb2 as pb
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table
from rich.tree import Tree

from opml_bundle_store_contract.client import BundleStoreClient, files_from_paths
from opml_common.cligroup import ClientSession, output_console, pass_session, service_group

console = output_console()


def _state_path() -> Path:
    return Path(os.environ.get("OPML_CLI_HOME", Path.home() / ".opml")) / "cli.json"


def _load_state() -> dict:
    path = _state_path()
    return json.loads(path.read_text()) if path.exists() else {}


def _save_state(state: dict) -> None:
    path = _state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=2))


def _context(session: ClientSession) -> str:
    """The context of the command: ``--context``, else the current one."""
    context = session.options["context"] or _load_state().get("bundle_context")
    if not context:
        raise click.UsageError("no context: pass --context or run `opml bundle context switch NAME`")
    return context


@service_group("bundle", service="bundle-store", client=BundleStoreClient, default_target="127.0.0.1:50051",
               options=(click.option("-c", "--context", "context", default=None,
                                     help="Context to use instead of the current one."),))
def bundle() -> None:
    """Versioned, immutable bundles of files and values, with lineage (after Disdat)."""


# -- contexts -----------------------------------------------------------------------------------

@bundle.group("context")
def context_group() -> None:
    """Create, list, switch and bind contexts to S3 remotes."""


@context_group.command("create")
@click.argument("name")
@click.option("--remote", default="", help="s3://bucket/prefix to push to and pull from.")
@pass_session
def context_create(session: ClientSession, name: str, remote: str) -> None:
    with session.client() as client:
        created = client.create_context(name, remote)
    console.print(f"created {created.name} {created.remote_url or '(local only)'}")


@context_group.command("ls")
@pass_session
def context_ls(session: ClientSession) -> None:
    current = _load_state().get("bundle_context")
    with session.client() as client:
        contexts = client.list_contexts()
    table = Table("", "context", "remote", "bundles")
    for item in contexts:
        name = item.name.removeprefix("contexts/")
        table.add_row("*" if name == current else "", name, item.remote_url or "-", str(item.bundle_count))
    console.print(table)


@context_group.command("switch")
@click.argument("name")
@pass_session
def context_switch(session: ClientSession, name: str) -> None:
    with session.client() as client:
        client.get_context(name)
    _save_state({**_load_state(), "bundle_context": name})
    console.print(f"switched to {name}")


@context_group.command("remote")
@click.argument("name")
@click.argument("remote_url")
@pass_session
def context_remote(session: ClientSession, name: str, remote_url: str) -> None:
    """Bind NAME to REMOTE_URL (s3://bucket/prefix); '' unbinds."""
    with session.client() as client:
        updated = client.set_remote(name, remote_url)
    console.print(f"{updated.name} -> {updated.remote_url or '(local only)'}")


# -- bundles ------------------------------------------------------------------------------------

def _pairs(items: tuple[str, ...], option: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"must be KEY=VALUE, but got {item!r}", param_hint=option)
        pairs[key] = value
    return pairs


def _typed(value: str) -> int | float | bool | str:
    """'3' -> 3, '0.5' -> 0.5, 'true' -> True, anything else stays a string."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


@bundle.command("add")
@click.argument("name")
@click.argument("paths", nargs=-1, type=click.Path(exists=True, path_type=Path))
@click.option("--value", "values", multiple=True, help="KEY=VALUE; numbers and true/false are typed.")
@click.option("--tag", "tags", multiple=True, help="KEY=VALUE tag.")
@click.option("--input", "inputs", multiple=True, help="UUID of an input bundle (lineage).")
@click.option("--code-version", default="", help="Code version that produced the bundle.")
@click.option("--param", "params", multiple=True, help="KEY=VALUE parameter (lineage).")
@click.option("--commit", is_flag=True, help="Commit right away.")
@click.option("--idempotency-key", default="", help="Run again with the same key (on any replica), the add returns "
              "the bundle the first run added instead of adding another (refused if its content differs).")
@pass_session
def add(session: ClientSession, name: str, paths: tuple[Path, ...], values, tags, inputs, code_version, params,
        commit: bool, idempotency_key: str) -> None:
    """Add a bundle NAME from files and directories PATHS and --value entries."""
    lineage = pb.Lineage(input_uuids=list(inputs), code_version=code_version, parameters=_pairs(params, "--param"))
    with session.client() as client:
        added = client.add(_context(session), name, files_from_paths(list(paths)),
                           values={k: _typed(v) for k, v in _pairs(values, "--value").items()},
                           tags=_pairs(tags, "--tag"), lineage=lineage, commit=commit,
                           idempotency_key=idempotency_key)
    state = "committed" if added.committed else "uncommitted"
    console.print(f"added {added.bundle_name} {added.uuid} ({len(added.files)} files, {state})")


@bundle.command("ls")
@click.argument("name", required=False, default="")
@click.option("--tag", "tags", multiple=True, help="KEY=VALUE; all must match.")
@click.option("--committed", is_flag=True, help="Only committed bundles.")
@click.option("--latest", is_flag=True, help="Only the latest version of each name.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@pass_session
def ls(session: ClientSession, name: str, tags, committed: bool, latest: bool, as_json: bool) -> None:
    """List bundles, newest first."""
    with session.client() as client:
        bundles = client.list_bundles(_context(session), bundle_name=name, tags=_pairs(tags, "--tag"),
                                      committed_only=committed, latest_only=latest)
    if as_json:
        click.echo(json.dumps([MessageToDict(b) for b in bundles], indent=2))
        return
    table = Table("name", "uuid", "created", "committed", "files", "tags", "remote")
    for item in bundles:
        table.add_row(item.bundle_name, item.uuid, item.create_time.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"),
                      "yes" if item.committed else "no", str(len(item.files)),
                      ",".join(f"{k}={v}" for k, v in sorted(item.tags.items())), item.remote_url or "-")
    console.print(table)


@bundle.command("cat")
@click.argument("ref")
@click.option("--file", "path", default=None, help="Write this file's bytes to stdout instead.")
@pass_session
def cat(session: ClientSession, ref: str, path: str | None) -> None:
    """Show bundle REF (uuid or name = latest): files, values, lineage."""
    with session.client() as client:
        if path:
            for chunk in client.read_file(_context(session), ref, path):
                sys.stdout.buffer.write(chunk)
            return
        shown = client.get_bundle(_context(session), ref)
    click.echo(json.dumps(MessageToDict(shown), indent=2))


@bundle.command("get")
@click.argument("ref")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Directory to write into.")
@pass_session
def get(session: ClientSession, ref: str, output: Path) -> None:
    """Download bundle REF's files into a directory (verified against their hashes)."""
    with session.client() as client:
        written = client.download(_context(session), ref, output)
    console.print(f"wrote {len(written)} files under {output}")


@bundle.command("commit")
@click.argument("ref")
@pass_session
def commit(session: ClientSession, ref: str) -> None:
    """Commit bundle REF: it becomes immutable and pushable."""
    with session.client() as client:
        done = client.commit(_context(session), ref)
    console.print(f"committed {done.bundle_name} {done.uuid}")


def _show_transfer(stream, verb: str) -> list[pb.Bundle]:
    with Progress(TextColumn(f"{verb} [progress.percentage]{{task.percentage:>3.0f}}%"), BarColumn(),
                  DownloadColumn(), TransferSpeedColumn(), TextColumn("{task.fields[files]}"),
                  console=console, transient=True) as progress:
        task = progress.add_task(verb, total=None, files="")
        for message in stream:
            progress.update(task, completed=message.bytes_done, total=message.bytes_total or None,
                            files=f"{message.files_done}/{message.files_total} files")
            if message.done:
                return list(message.bundles)
    return []


@bundle.command("push")
@click.argument("ref", required=False, default="")
@pass_session
def push(session: ClientSession, ref: str) -> None:
    """Push committed bundles (or just REF) to the context's remote."""
    with session.client() as client:
        pushed = _show_transfer(client.push(_context(session), ref), "push")
    for item in pushed:
        console.print(f"pushed {item.bundle_name} {item.uuid} -> {item.remote_url}")
    if not pushed:
        console.print("nothing to push")


@bundle.command("pull")
@click.argument("name", required=False, default="")
@click.option("--localize", is_flag=True, help="Also download and verify the files.")
@pass_session
def pull(session: ClientSession, name: str, localize: bool) -> None:
    """Pull bundle metadata (and files with --localize) from the context's remote."""
    with session.client() as client:
        pulled = _show_transfer(client.pull(_context(session), name, localize=localize), "pull")
    console.print(f"pulled {len(pulled)} bundles{' (localized)' if localize else ''}")


@bundle.command("rm")
@click.argument("ref")
@click.option("--remote", is_flag=True, help="Also delete it on the remote.")
@pass_session
def rm(session: ClientSession, ref: str, remote: bool) -> None:
    """Delete bundle REF (admin role)."""
    with session.client() as client:
        deleted = client.delete(_context(session), ref, remote=remote)
    console.print(f"deleted {len(deleted)} bundles: {', '.join(deleted)}")


@bundle.command("gc")
@click.option("--remote", is_flag=True, help="Collect the remote's blobs.")
@click.option("--grace", default=3600, show_default=True, help="Keep blobs younger than this many seconds.")
@click.option("--dry-run", is_flag=True)
@pass_session
def gc(session: ClientSession, remote: bool, grace: int, dry_run: bool) -> None:
    """Remove blobs that no bundle references (admin role)."""
    with session.client() as client:
        report = client.gc(_context(session), remote=remote, grace_seconds=grace, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    console.print(f"{verb} {report.blobs_removed} blobs ({report.bytes_freed} bytes); kept {report.blobs_kept}")


@bundle.group("grant")
def grant_group() -> None:
    """Upload grants: the scoped tokens a job uploads its bundle with."""


@grant_group.command("revoke")
@click.argument("grant_id")
@pass_session
def grant_revoke(session: ClientSession, grant_id: str) -> None:
    """Refuse the upload grant GRANT_ID of the context on every replica from now on."""
    context = _context(session)
    with session.client() as client:
        revoked = client.revoke_upload_grant(context, grant_id)
    console.print(f"revoked upload grant {revoked.grant_id} of context {context} "
                  f"(since {revoked.revoke_time.ToDatetime().isoformat()}Z)")


@bundle.command("lineage")
@click.argument("ref")
@click.option("--direction", type=click.Choice(["up", "down", "both"]), default="both", show_default=True)
@click.option("--depth", default=10, show_default=True)
@pass_session
def lineage(session: ClientSession, ref: str, direction: str, depth: int) -> None:
    """Show the lineage graph of REF: its inputs (up) and the bundles made from it (down)."""
    kinds = {"up": pb.GetLineageRequest.UPSTREAM, "down": pb.GetLineageRequest.DOWNSTREAM,
             "both": pb.GetLineageRequest.BOTH}
    with session.client() as client:
        root = client.get_bundle(_context(session), ref)
        graph = client.lineage(_context(session), ref, direction=kinds[direction], max_depth=depth)
    by_uuid = {b.uuid: b for b in graph.bundles}

    def label(uuid: str) -> str:
        return f"{by_uuid[uuid].bundle_name} [dim]{uuid}[/dim]" if uuid in by_uuid else uuid

    tree = Tree(label(root.uuid))
    ups = Tree("inputs (upstream)")
    downs = Tree("outputs (downstream)")
    for edge in graph.edges:
        if edge.output_uuid == root.uuid or edge.output_uuid in _ancestors(graph, root.uuid):
            ups.add(f"{label(edge.input_uuid)} -> {label(edge.output_uuid)}")
        else:
            downs.add(f"{label(edge.input_uuid)} -> {label(edge.output_uuid)}")
    tree.add(ups)
    tree.add(downs)
    console.print(tree)


def _ancestors(graph: pb.LineageGraph, uuid: str) -> set[str]:
    seen, frontier = set(), {uuid}
    while frontier:
        frontier = {e.input_uuid for e in graph.edges if e.output_uuid in frontier} - seen
        seen |= frontier
    return seen
