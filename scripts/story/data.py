"""Step 1, data: what the inspection lines deliver each day becomes a committed span bundle.

Shows the bundle-store as the platform's data plane: each day's span (one CSV per line, from
``inspection_data.span_csv``) is committed in plant-a as bundle ``inspections`` tagged ``span`` (the
day) and ``version`` (what the job-orchestrator's pipelines ingest); the spans are pushed to S3 and
pulled into a second plant's context with every blob verified, read back byte for byte, their events
read from Kafka with a plain consumer, and downloaded for the steps that train.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from inspection_data import LINES, span_csv
from opml.bundles.v1 import bundles_pb2 as pb
from opml.bundles.v1 import events_pb2 as bundle_events

from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.errors import AlreadyExists

from .context import Ours, Story, show_events

CONTEXT, MIRROR = "plant-a", "plant-b"
SPANS = "inspections"
"""The span bundles' name: one version per day (tag ``span``), a file per line."""


def ensure_context(client: BundleStoreClient, name: str, remote: str) -> None:
    try:
        client.create_context(name, remote)
    except AlreadyExists:
        client.set_remote(name, remote)


def of_bundles(uuids: set[str]) -> Ours:
    """This run's bundle events: of the span versions it committed (the subject is the bundle name, the
    same in every run)."""
    messages = {"opml.bundles.v1.BundleCommitted": bundle_events.BundleCommitted,
                "opml.bundles.v1.BundlePushed": bundle_events.BundlePushed}

    def ours(kind: str, subject: str, value: bytes) -> bool:
        return (subject == SPANS and kind in messages
                and messages[kind].FromString(value).bundle.uuid in uuids)
    return ours


def span_files(story: Story, day: int, lighting: dict[int, float]) -> dict[str, Path]:
    """The day's span, a CSV per line (its lamps as ``lighting`` says, 1 when not named)."""
    folder = story.workdir / "spans-out" / str(day)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for line in LINES:
        path = folder / f"line-{line}.csv"
        path.write_bytes(span_csv(line, day, story.scale.span_rows, lighting=lighting.get(line, 1.0)))
        files[path.name] = path
    return files


def commit_span(story: Story, client: BundleStoreClient, day: int,
                lighting: dict[int, float] | None = None) -> pb.Bundle:
    """Commit the ``day``'s span of every line; returns the committed bundle."""
    lighting = lighting or {}
    return client.add(
        CONTEXT, SPANS, span_files(story, day, lighting), commit=True,
        values={"rows_per_line": story.scale.span_rows, **{f"lighting.line{n}": v for n, v in lighting.items()}},
        tags={"span": str(day), "version": "0", "task": "vision-inspection"},
        lineage=pb.Lineage(code_version="inspection_data",
                           parameters={"day": str(day), **{f"lighting.line{n}": str(v) for n, v in lighting.items()}}))


def newest_span(client: BundleStoreClient) -> tuple[int, dict[int, float]]:
    """The newest committed span's day and each line's lamps in it (1 when it names none): how the lines
    are lit now. A later run of the story goes on from what an earlier one's loop committed."""
    spans = [b for b in client.list_bundles(CONTEXT, bundle_name=SPANS, committed_only=True) if "span" in b.tags]
    if not spans:
        raise SystemExit(f"no span of {SPANS} is committed in {CONTEXT}")
    newest = max(spans, key=lambda b: int(b.tags["span"]))
    return int(newest.tags["span"]), {line: newest.values[f"lighting.line{line}"].float_value
                                      if f"lighting.line{line}" in newest.values else 1.0 for line in LINES}


def download_spans(story: Story, client: BundleStoreClient, committed: dict[int, pb.Bundle]) -> Path:
    """The committed spans as the bundle-store serves them (``<day>/line-<n>.csv``), readable by jobs."""
    spans = story.workdir / "spans"
    spans.mkdir(exist_ok=True)
    spans.chmod(0o755)
    for day, bundle in committed.items():
        client.download(CONTEXT, bundle.uuid, spans / str(day))
        (spans / str(day)).chmod(0o755)
        for path in (spans / str(day)).iterdir():
            path.chmod(0o644)
    return spans


def run(story: Story) -> str:
    with BundleStoreClient(story.bundles_target) as client:
        for context in (CONTEXT, MIRROR):
            ensure_context(client, context, story.remote)
        print(f"   {story.scale.days} days of {len(LINES)} lines, {story.scale.span_rows} rows a line: commit each "
              f"day in {CONTEXT} as {SPANS} tagged span=<day> version=0", flush=True)
        committed = {day: commit_span(story, client, day) for day in range(story.scale.days)}
        for day, bundle in committed.items():
            print(f"   span {day}: {bundle.uuid} committed={bundle.committed} files={len(bundle.files)} "
                  f"hash={bundle.content_hash[:16]}")
        print(f"   push to {story.remote}")
        for day, bundle in committed.items():
            pushed = [m for m in client.push(CONTEXT, bundle.uuid) if m.done][0]
            print(f"   span {day}: {pushed.files_done}/{pushed.files_total} files, {pushed.bytes_done} bytes")
        print(f"   {MIRROR}: pull with --localize (every blob verified against its sha256)")
        pulled = [m for m in client.pull(MIRROR, SPANS, localize=True) if m.done][0]
        print(f"   {len(pulled.bundles)} bundle versions pulled")
        last = story.scale.days - 1
        source, copy = committed[last], client.get_bundle(MIRROR, committed[last].uuid)
        target = story.workdir / "mirror"
        client.download(MIRROR, source.uuid, target)
        print(f"   verify {MIRROR}'s copy of span {last} byte for byte")
        for line in LINES:
            name = f"line-{line}.csv"
            ours = hashlib.sha256((story.workdir / "spans-out" / str(last) / name).read_bytes()).hexdigest()
            theirs = hashlib.sha256((target / name).read_bytes()).hexdigest()
            print(f"   {name:<12} {theirs[:16]} {'ok' if ours == theirs else 'MISMATCH'}")
            if ours != theirs:
                raise SystemExit(f"{MIRROR}'s copy of {name} differs from {CONTEXT}'s")
        if copy.content_hash != source.content_hash:
            raise SystemExit(f"content hash differs between contexts: {copy.content_hash} != {source.content_hash}")
        print(f"   content hash equal in both contexts: {copy.content_hash[:16]}")
        print(f"   events on {BUNDLES.name}")
        show_events(story, BUNDLES.full_name(story.topic_prefix),
                    {"opml.bundles.v1.BundleCommitted", "opml.bundles.v1.BundlePushed"},
                    of_bundles({b.uuid for b in committed.values()}))
        story.spans_dir = download_spans(story, client, committed)
    return f"{len(committed)} spans committed ({len(LINES)} lines each), pushed, pulled and verified"
