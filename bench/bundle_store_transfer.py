"""Bundle-store transfer benchmark: BundleStore push/pull against the raw minio client.

Measured in one run, on the same S3 server and the same bytes:

* large: one file of ``--large-mib`` MiB (random) - minio ``fput_object`` / ``fget_object`` (their
  defaults) vs ``BundleStore.push`` / ``pull(localize=True)`` of a bundle holding it;
* small: ``--small-count`` files of ``--small-kib`` KiB - a sequential loop of ``put_object`` /
  ``get_object`` (each written to its own file) vs push / pull of one bundle holding them.

Every repetition pushes to a fresh remote prefix and pulls into a fresh store, so nothing is
skipped by deduplication; pulls verify every blob's sha256 and fsync it, the raw client does
neither, so the large download is also compared with "fget_object + sha256 of the file". The
table shows the median over ``--repeat`` repetitions; the raw and our operation of each pair run
back to back in alternating order, each after the same page-cache recycling.

Starts its own embedded infrastructure (opml_devstack.devinfra.DevInfra) unless OPML_S3_ENDPOINT is
set, in which case that S3 endpoint (and OPML_S3_ACCESS_KEY / OPML_S3_SECRET_KEY) are used.

    .venv/bin/python bench/bundle_store_transfer.py                       # 256 MiB, 10,000 x 4 KiB
    .venv/bin/python bench/bundle_store_transfer.py --large-mib 32 --small-count 500 --repeat 1
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import platform
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from opml_bundle_store.core import BundleStore
from opml_bundle_store.core.signing import ManifestKeys
from opml_common.config import PlatformSettings
from opml_common.storage import s3_client

MIB = 1024 * 1024


@contextlib.contextmanager
def s3_settings(workdir: Path) -> Iterator[PlatformSettings]:
    if os.environ.get("OPML_S3_ENDPOINT"):
        yield PlatformSettings()
        return
    from opml_devstack.devinfra import DevInfra

    with DevInfra(workdir=workdir / "infra") as endpoints:
        yield PlatformSettings(
            s3_endpoint=endpoints.s3_endpoint,
            s3_access_key=endpoints.s3_access_key,
            s3_secret_key=endpoints.s3_secret_key,
        )


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_random(path: Path, size: int) -> str:
    hasher = hashlib.sha256()
    with open(path, "wb") as handle:
        remaining = size
        while remaining:
            chunk = os.urandom(min(16 * MIB, remaining))
            hasher.update(chunk)
            handle.write(chunk)
            remaining -= len(chunk)
    return hasher.hexdigest()


def sha256_file(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(16 * MIB), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


class Bench:
    def __init__(self, args: argparse.Namespace, settings: PlatformSettings, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.client = s3_client(settings)
        self.bucket = f"bench-{uuid.uuid4().hex[:12]}"
        self.client.make_bucket(self.bucket)
        self.results: dict[str, list[float]] = {}
        self.recycle_bytes = max(3 * args.large_mib * MIB, 256 * MIB)
        self.store_kwargs = {
            "transfer_workers": args.workers, "part_size": args.part_mib * MIB,
            "multipart_threshold": args.threshold_mib * MIB, "range_size": args.range_mib * MIB,
            "upload_streams": args.upload_streams, "download_streams": args.download_streams,
            "manifest_keys": ManifestKeys([secrets.token_hex(32)]),  # the pushing and the pulling store share it
        }

    def record(self, name: str, seconds: float) -> None:
        self.results.setdefault(name, []).append(seconds)
        print(f"  {name:<12} {seconds:8.2f} s", flush=True)

    def new_store(self, tag: str) -> BundleStore:
        return BundleStore(self.workdir / f"home-{tag}-{uuid.uuid4().hex[:6]}", self.client, **self.store_kwargs)

    # The raw and our operation of each pair run back to back, in alternating order, so that
    # load from elsewhere on the machine hits both alike. Each operation's output is checked and
    # deleted right after it is timed, so both write into page cache that was just freed (on a
    # VM, pages touched for the first time cost far more than recycled ones).

    Op = tuple[str, Callable[[], object], Callable[[], object]]

    def pair(self, rep: int, first: Op, second: Op) -> None:
        for name, fn, cleanup in ((first, second) if rep % 2 == 0 else (second, first)):
            self.recycle_pages()
            self.record(name, timed(fn))
            cleanup()

    def recycle_pages(self) -> None:
        """Write and delete a scratch file, so the next operation (client and S3 server alike)
        finds freshly freed, already touched pages: on a VM, first-touch page faults otherwise
        decide which side of a pair is faster, not the code under test."""
        scratch = self.workdir / "scratch"
        chunk = bytes(16 * MIB)
        with open(scratch, "wb") as handle:
            for _ in range(self.recycle_bytes // len(chunk)):
                handle.write(chunk)
        scratch.unlink()

    # large ---------------------------------------------------------------------------------------

    def large(self, rep: int, source: Path, digest: str) -> None:
        key = f"raw-large/{rep}"
        out = self.workdir / "raw-large.out"
        remote = f"s3://{self.bucket}/ours-large-{rep}"
        pusher, puller = self.new_store("push"), self.new_store("pull")
        pusher.create_context("bench", remote)
        puller.create_context("bench", remote)
        with pusher.new_bundle("bench", "large") as writer:
            writer.add_path(source, "large.bin")
            writer.finish(commit=True)

        def check_raw() -> None:
            # Timed too: what a raw download costs once it is checked as a pull checks it.
            seconds = timed(lambda: sha256_file(out) == digest or sys.exit("raw download does not match"))
            self.results.setdefault("raw_get_sha_L", []).append(self.results["raw_get_L"][-1] + seconds)
            out.unlink()

        def check_pull() -> None:
            bundle = puller.get_bundle("bench", "large")
            assert bundle.localized and bundle.files[0].sha256 == digest, "pulled bundle does not match"
            self.drop(puller)

        self.pair(rep, ("raw_put_L", lambda: self.client.fput_object(self.bucket, key, str(source)), lambda: None),
                  ("push_L", lambda: pusher.push("bench"), lambda: None))
        self.drop(pusher)
        self.pair(rep, ("raw_get_L", lambda: self.client.fget_object(self.bucket, key, str(out)), check_raw),
                  ("pull_L", lambda: puller.pull("bench", localize=True), check_pull))

    def drop(self, store: BundleStore) -> None:
        store.close()
        shutil.rmtree(store.home, ignore_errors=True)

    # small ---------------------------------------------------------------------------------------

    def small(self, rep: int, source: Path, blobs: list[bytes]) -> None:
        prefix = f"raw-small/{rep}/"
        out = self.workdir / "raw-small-out"

        def raw_put() -> None:
            for index, data in enumerate(blobs):
                self.client.put_object(self.bucket, f"{prefix}{index:06d}", io.BytesIO(data), len(data))

        def raw_get() -> None:
            out.mkdir()
            for index in range(len(blobs)):
                response = self.client.get_object(self.bucket, f"{prefix}{index:06d}")
                try:
                    (out / f"{index:06d}").write_bytes(response.read())
                finally:
                    response.close()
                    response.release_conn()

        def check_raw() -> None:
            assert len(list(out.iterdir())) == len(blobs)
            shutil.rmtree(out)

        def check_pull() -> None:
            assert len(puller.get_bundle("bench", "small").files) == len(blobs)
            self.drop(puller)

        remote = f"s3://{self.bucket}/ours-small-{rep}"
        pusher, puller = self.new_store("push"), self.new_store("pull")
        pusher.create_context("bench", remote)
        puller.create_context("bench", remote)
        with pusher.new_bundle("bench", "small") as writer:
            self.record("add_S", timed(lambda: (writer.add_path(source), writer.finish(commit=True))))
        self.pair(rep, ("raw_put_S", raw_put, lambda: None), ("push_S", lambda: pusher.push("bench"), lambda: None))
        self.drop(pusher)
        self.pair(rep, ("raw_get_S", raw_get, check_raw),
                  ("pull_S", lambda: puller.pull("bench", localize=True), check_pull))

    # report --------------------------------------------------------------------------------------

    def table(self, large_bytes: int, small_bytes: int, small_count: int) -> str:
        med = {name: statistics.median(values) for name, values in self.results.items()}
        rows = []
        if "push_L" in med:
            for op, raw, ours in (("upload", "raw_put_L", "push_L"), ("download", "raw_get_L", "pull_L"),
                                  ("download, raw + sha256 check", "raw_get_sha_L", "pull_L")):
                rows.append((f"{large_bytes // MIB} MiB x 1 {op}", large_bytes / MIB / med[raw],
                             large_bytes / MIB / med[ours], med[raw] / med[ours], None, None))
        if "push_S" in med:
            for op, raw, ours in (("upload", "raw_put_S", "push_S"), ("download", "raw_get_S", "pull_S")):
                rows.append((f"{self.args.small_kib} KiB x {small_count} {op}", small_bytes / MIB / med[raw],
                             small_bytes / MIB / med[ours], med[raw] / med[ours],
                             small_count / med[raw], small_count / med[ours]))
        lines = [
            "| case | raw MB/s | ours MB/s | ours/raw | raw files/s | ours files/s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for case, raw_mbs, ours_mbs, ratio, raw_fps, ours_fps in rows:
            fps = (f"{raw_fps:,.0f} | {ours_fps:,.0f}" if raw_fps is not None else "- | -")
            lines.append(f"| {case} | {raw_mbs:,.1f} | {ours_mbs:,.1f} | {ratio:.2f}x | {fps} |")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large-mib", type=int, default=256, help="size of the large file (0 skips it)")
    parser.add_argument("--small-count", type=int, default=10_000, help="number of small files (0 skips them)")
    parser.add_argument("--small-kib", type=int, default=4, help="size of each small file")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; the table shows medians")
    parser.add_argument("--workers", type=int, default=32, help="BundleStore transfer_workers")
    parser.add_argument("--part-mib", type=int, default=16, help="BundleStore part_size in MiB")
    parser.add_argument("--threshold-mib", type=int, default=64, help="BundleStore multipart_threshold in MiB")
    parser.add_argument("--range-mib", type=int, default=32, help="BundleStore range_size in MiB")
    parser.add_argument("--upload-streams", type=int, default=4, help="BundleStore upload_streams")
    parser.add_argument("--download-streams", type=int, default=4, help="BundleStore download_streams")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="bundle-bench-", dir=args.workdir))
    try:
        with s3_settings(workdir) as settings:
            bench = Bench(args, settings, workdir)
            large_bytes = args.large_mib * MIB
            small_bytes = args.small_count * args.small_kib * 1024
            large_source = workdir / "large.bin"
            digest = write_random(large_source, large_bytes) if args.large_mib else ""
            small_source = workdir / "small"
            blobs = [os.urandom(args.small_kib * 1024) for _ in range(args.small_count)]
            small_source.mkdir()
            for index, data in enumerate(blobs):
                (small_source / f"{index // 1000:03d}").mkdir(exist_ok=True)
                (small_source / f"{index // 1000:03d}" / f"{index:06d}.bin").write_bytes(data)
            print(f"S3 endpoint {settings.s3_endpoint}, bucket {bench.bucket}", flush=True)
            for rep in range(args.repeat):
                print(f"repetition {rep + 1}/{args.repeat}", flush=True)
                if args.large_mib:
                    bench.large(rep, large_source, digest)
                if args.small_count:
                    bench.small(rep, small_source, blobs)
            print()
            print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
                  f"{platform.platform()}")
            print(f"settings: transfer_workers={args.workers}, part_size={args.part_mib} MiB, "
                  f"multipart_threshold={args.threshold_mib} MiB, range_size={args.range_mib} MiB, "
                  f"upload_streams={args.upload_streams}, download_streams={args.download_streams}; "
                  f"median of {args.repeat}; MB = MiB")
            print("per-run seconds: " + "; ".join(
                f"{name} " + " ".join(f"{value:.2f}" for value in values) for name, values in bench.results.items()))
            print()
            print(bench.table(large_bytes, small_bytes, args.small_count))
            if "add_S" in bench.results:
                print(f"\n(add of the {args.small_count} small files into the local store: "
                      f"{statistics.median(bench.results['add_S']):.2f} s, not part of the table)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
