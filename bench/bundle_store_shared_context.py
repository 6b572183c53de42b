"""Bundle-store shared contexts: what a replica pays for the S3 remote being the truth.

One run, one S3 server, two stores (two homes, the same manifest keys): a local context of store A
(the baseline: the single-store model, the home is the truth) and a context shared through one S3
remote (``BundleStore.share_context``), read through store B, which added none of its bundles.
Both contexts hold the same ``--bundles`` committed bundles over ``--names`` names. Measured (the
median of ``--repeat`` calls each, baseline and shared alternating):

* add and commit of a 1 KiB bundle (shared: written through, blobs then the signed manifest);
* add of a 1 KiB bundle, uncommitted (shared: staged, blobs then a signed manifest written if absent);
* add and commit of a 1 KiB bundle with a new idempotency key (shared: the name's LISTs for an earlier
  add of the key, staged first, which claims the key, then committed and pushed, the staged manifest removed);
* commit of an uncommitted bundle (shared: through B, a bundle A received: the name's LIST, the
  committed manifest written, the staged one removed);
* GetBundle by name (shared: one S3 LIST of the name's manifests first);
* ListBundles of one name, and of the whole context (shared: one LIST, every manifest not held
  fetched; here all are held after the first read, the steady state);
* the revocation check of an upload grant not revoked, made at each call its holder makes (shared: a
  HEAD of its revocation's key on the remote).

Starts its own embedded infrastructure unless OPML_S3_ENDPOINT is set (see bundle_store_transfer.py).

    .venv/bin/python bench/bundle_store_shared_context.py
    .venv/bin/python bench/bundle_store_shared_context.py --bundles 1000 --names 50 --repeat 50
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bundle_store_transfer import s3_settings

from opml_bundle_store.core import BundleStore
from opml_bundle_store.core.signing import ManifestKeys
from opml_common.storage import s3_client


def _add(store: BundleStore, context: str, name: str, data: bytes, *, commit: bool = True, key: str = "") -> str:
    with store.new_bundle(context, name, idempotency_key=key) as writer:
        writer.add_file("weights.bin", [data])
        return writer.finish(commit=commit).uuid


def _medians(baseline: Callable[[], object], shared: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median seconds of each, their calls alternating (so both see the same machine)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for call, sink in ((baseline, times[0]), (shared, times[1])):
            started = time.perf_counter()
            call()
            sink.append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundles", type=int, default=200, help="committed bundles in each context")
    parser.add_argument("--names", type=int, default=20, help="bundle names they are versions of")
    parser.add_argument("--repeat", type=int, default=30, help="calls measured per operation")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="opml-bench-shared-") as tmp, s3_settings(Path(tmp)) as settings:
        s3 = s3_client(settings)
        keys = ManifestKeys.parse(secrets.token_hex(32))
        remote = f"s3://bench-shared-{uuid.uuid4().hex[:12]}/models"
        with BundleStore(Path(tmp) / "a", s3, manifest_keys=keys) as a, \
                BundleStore(Path(tmp) / "b", s3, manifest_keys=keys) as b:
            a.create_context("local")
            a.share_context("shared", remote)
            b.share_context("shared", remote)
            for i in range(args.bundles):
                for context in ("local", "shared"):
                    _add(a, context, f"model-{i % args.names}", f"{context} {i}".encode() * 64)
            b.list_bundles("shared")  # B's first read: every manifest fetched once
            name = "model-3"
            drafts = {context: iter([_add(a, context, "draft", secrets.token_bytes(1024), commit=False)
                                     for _ in range(args.repeat)]) for context in ("local", "shared")}
            rows = {
                "add + commit, 1 KiB": _medians(lambda: _add(a, "local", "new", secrets.token_bytes(1024)),
                                                lambda: _add(a, "shared", "new", secrets.token_bytes(1024)),
                                                args.repeat),
                "add + commit, keyed, 1 KiB": _medians(
                    lambda: _add(a, "local", "keyed", secrets.token_bytes(1024), key=uuid.uuid4().hex),
                    lambda: _add(a, "shared", "keyed", secrets.token_bytes(1024), key=uuid.uuid4().hex), args.repeat),
                "add uncommitted, 1 KiB": _medians(
                    lambda: _add(a, "local", "draft", secrets.token_bytes(1024), commit=False),
                    lambda: _add(a, "shared", "draft", secrets.token_bytes(1024), commit=False), args.repeat),
                "commit (shared: through B)": _medians(lambda: a.commit("local", next(drafts["local"])),
                                                       lambda: b.commit("shared", next(drafts["shared"])),
                                                       args.repeat),
                "GetBundle by name": _medians(lambda: a.get_bundle("local", name),
                                              lambda: b.get_bundle("shared", name), args.repeat),
                "ListBundles, one name": _medians(lambda: a.list_bundles("local", bundle_name=name),
                                                  lambda: b.list_bundles("shared", bundle_name=name), args.repeat),
                "ListBundles, whole context": _medians(lambda: a.list_bundles("local"),
                                                       lambda: b.list_bundles("shared"), args.repeat),
                "grant revocation check": _medians(lambda: a.upload_grant_revoked("local", "0123456789abcdef"),
                                                   lambda: b.upload_grant_revoked("shared", "0123456789abcdef"),
                                                   args.repeat),
            }
            assert {x.uuid for x in a.list_bundles("shared")} == {x.uuid for x in b.list_bundles("shared")}
    print(f"{args.bundles} committed bundles of {args.names} names per context; median of {args.repeat} calls")
    print(f"{'operation':30} {'local (A)':>12} {'shared (B)':>12} {'ratio':>8}")
    for what, (local, shared) in rows.items():
        print(f"{what:30} {local * 1000:>9.2f} ms {shared * 1000:>9.2f} ms {shared / local:>7.1f}x")


if __name__ == "__main__":
    main()
