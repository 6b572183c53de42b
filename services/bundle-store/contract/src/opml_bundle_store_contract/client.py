"""Python client of the bundle-store API, used by the CLI and by other services.

Failed calls raise the platform's domain errors (``NotFound``, ``InvalidArgument``...), never a
bare ``grpc.RpcError``. Files are streamed in chunks, with their sha256 sent ahead so the
server rejects a bundle whose bytes were damaged on the way.
"""

from __future__ import annotations

import hashlib
import mimetypes
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from opml.bundles.v1 import bundles_pb2 as pb
from opml.bundles.v1 import bundles_pb2_grpc

from opml_bundle_store_contract.paths import contained, path_violations
from opml_bundle_store_contract.values import Value, value_to_proto
from opml_common.errors import DataLoss
from opml_common.grpc.client import ServiceClient, pages

CHUNK_BYTES = 1024 * 1024
mimetypes.add_type("application/onnx", ".onnx")

FileSource = Path | bytes


def media_type_of(path: str) -> str:
    return mimetypes.guess_type(path)[0] or "application/octet-stream"


def files_from_paths(paths: list[Path]) -> dict[str, Path]:
    """Bundle paths for local files and directory trees: a file keeps its name, a tree its layout."""
    files: dict[str, Path] = {}
    for path in paths:
        if path.is_dir():
            for child in sorted(p for p in path.rglob("*") if p.is_file()):
                files[f"{path.name}/{child.relative_to(path).as_posix()}"] = child
        else:
            files[path.name] = path
    return files


class BundleStoreClient(ServiceClient):
    """One method per BundleStore RPC; ``with BundleStoreClient(target, token=...) as client:``."""

    stub_class = bundles_pb2_grpc.BundleStoreStub

    # -- contexts -----------------------------------------------------------------------------

    def create_context(self, context_id: str, remote_url: str = "") -> pb.Context:
        return self.stub.CreateContext(pb.CreateContextRequest(context_id=context_id, remote_url=remote_url))

    def list_contexts(self) -> list[pb.Context]:
        return list(pages(lambda token: self.stub.ListContexts(pb.ListContextsRequest(page_token=token)),
                          lambda reply: reply.contexts))

    def get_context(self, context_id: str) -> pb.Context:
        return self.stub.GetContext(pb.GetContextRequest(name=f"contexts/{context_id}"))

    def set_remote(self, context_id: str, remote_url: str) -> pb.Context:
        return self.stub.UpdateContextRemote(
            pb.UpdateContextRemoteRequest(name=f"contexts/{context_id}", remote_url=remote_url))

    # -- bundles ------------------------------------------------------------------------------

    def add(self, context_id: str, bundle_name: str, files: Mapping[str, FileSource], *,
            values: Mapping[str, Value] | None = None, tags: Mapping[str, str] | None = None,
            lineage: pb.Lineage | None = None, commit: bool = False,
            media_types: Mapping[str, str] | None = None, idempotency_key: str = "") -> pb.Bundle:
        """Add a bundle of ``files`` (bundle path -> local file or bytes) and typed ``values``.
        ``idempotency_key``: a retry of this add with the same key (on any replica) adds nothing and
        returns the bundle the first one added; an add of the key with other content raises AlreadyExists."""
        header = add_header(context_id, bundle_name, files, values=values, tags=tags, lineage=lineage,
                            commit=commit, media_types=media_types, idempotency_key=idempotency_key)

        def requests() -> Iterator[pb.AddBundleRequest]:
            yield pb.AddBundleRequest(header=header)
            for index, source in enumerate(files.values()):
                for chunk in _chunks(source):
                    yield pb.AddBundleRequest(chunk=pb.FileChunk(file_index=index, data=chunk))

        return self.stub.AddBundle(requests())

    def list_bundles(self, context_id: str, *, bundle_name: str = "", tags: Mapping[str, str] | None = None,
                     committed_only: bool = False, latest_only: bool = False) -> list[pb.Bundle]:
        def page(token: str) -> pb.ListBundlesResponse:
            return self.stub.ListBundles(pb.ListBundlesRequest(
                parent=f"contexts/{context_id}", bundle_name=bundle_name, tags=dict(tags or {}),
                committed_only=committed_only, latest_only=latest_only, page_token=token))

        return list(pages(page, lambda reply: reply.bundles))

    def get_bundle(self, context_id: str, ref: str) -> pb.Bundle:
        return self.stub.GetBundle(pb.GetBundleRequest(name=f"contexts/{context_id}/bundles/{ref}"))

    def read_file(self, context_id: str, ref: str, path: str) -> Iterator[bytes]:
        for chunk in self.stub.ReadBundleFile(
                pb.ReadBundleFileRequest(name=f"contexts/{context_id}/bundles/{ref}", path=path)):
            yield chunk.data

    def download(self, context_id: str, ref: str, destination: Path) -> list[Path]:
        """Write every file of the bundle under ``destination``, keeping the bundle's layout.

        The store's answer is not trusted with the local disk: every path it names is checked
        before anything is written (a bundle path by the store's own rules, and, joined to
        ``destination`` and resolved, inside the resolved ``destination``: no absolute path, no
        '..', no symlink under ``destination`` leading out), directories are made one level at a
        time without following symlinks, and files are opened with ``O_NOFOLLOW``.

        Raises: DataLoss naming the path when the store names one that would land outside
        ``destination`` (nothing is written then), and the errors of GetBundle and ReadBundleFile.
        """
        destination = Path(destination)
        bundle = self.get_bundle(context_id, ref)
        targets = download_targets(bundle, destination, self.target)
        destination.mkdir(parents=True, exist_ok=True)
        root = destination.resolve()
        for path in targets:
            with open_inside(root, path) as handle:
                handle.writelines(self.read_file(context_id, ref, path))
        return list(targets.values())

    def commit(self, context_id: str, ref: str) -> pb.Bundle:
        return self.stub.CommitBundle(pb.CommitBundleRequest(name=f"contexts/{context_id}/bundles/{ref}"))

    def push(self, context_id: str, ref: str = "") -> Iterator[pb.TransferProgress]:
        """Progress messages of the push; the last one has ``done`` set and the pushed bundles."""
        return self.stub.PushBundles(pb.PushBundlesRequest(parent=f"contexts/{context_id}", bundle=ref))

    def pull(self, context_id: str, bundle_name: str = "", *, localize: bool = False) -> Iterator[pb.TransferProgress]:
        return self.stub.PullBundles(pb.PullBundlesRequest(
            parent=f"contexts/{context_id}", bundle_name=bundle_name, localize=localize))

    def delete(self, context_id: str, ref: str, *, remote: bool = False) -> list[str]:
        reply = self.stub.DeleteBundle(
            pb.DeleteBundleRequest(name=f"contexts/{context_id}/bundles/{ref}", remote=remote))
        return list(reply.deleted_uuids)

    def gc(self, context_id: str, *, remote: bool = False, grace_seconds: int | None = None,
           dry_run: bool = False) -> pb.GarbageCollectResponse:
        """``grace_seconds`` None: the server's default (3600); 0: every unreferenced blob, now."""
        return self.stub.GarbageCollect(pb.GarbageCollectRequest(
            parent=f"contexts/{context_id}", remote=remote, grace_seconds=grace_seconds, dry_run=dry_run))

    def create_upload_grant(self, context_id: str, bundle_name: str, *, ttl_s: int, max_bytes: int) -> str:
        """A bearer token letting its holder add uncommitted versions of ``bundle_name`` into ``context_id``
        (each at most ``max_bytes``, for ``ttl_s`` seconds) and get and list them, nothing else: hand it
        to a job instead of a writer token (``BundleStoreClient(target, token=grant)``). A secret: never
        log it."""
        return self.issue_upload_grant(context_id, bundle_name, ttl_s=ttl_s, max_bytes=max_bytes).token

    def issue_upload_grant(self, context_id: str, bundle_name: str, *, ttl_s: int, max_bytes: int) -> pb.UploadGrant:
        """:meth:`create_upload_grant`'s whole reply: the token, and the grant's id and expiry, which its
        issuer keeps to revoke it (:meth:`revoke_upload_grant`) once the job it hands it to is over."""
        return self.stub.CreateUploadGrant(pb.CreateUploadGrantRequest(
            parent=f"contexts/{context_id}", bundle_name=bundle_name, ttl_seconds=ttl_s, max_bytes=max_bytes))

    def revoke_upload_grant(self, context_id: str, grant_id: str) -> pb.RevokedUploadGrant:
        """Revoke the upload grant ``grant_id`` (``UploadGrant.grant_id``, what logs name) of ``context_id``
        before it expires: every replica refuses it from now on, an upload in flight with it too. Its
        issuer calls it once the job it was given to is over."""
        return self.stub.RevokeUploadGrant(pb.RevokeUploadGrantRequest(parent=f"contexts/{context_id}",
                                                                       grant_id=grant_id))

    def lineage(self, context_id: str, ref: str, *, direction: int = pb.GetLineageRequest.BOTH,
                max_depth: int = 0) -> pb.LineageGraph:
        return self.stub.GetLineage(pb.GetLineageRequest(
            name=f"contexts/{context_id}/bundles/{ref}", direction=direction, max_depth=max_depth))


def add_header(context_id: str, bundle_name: str, files: Mapping[str, FileSource], *,
               values: Mapping[str, Value] | None = None, tags: Mapping[str, str] | None = None,
               lineage: pb.Lineage | None = None, commit: bool = False,
               media_types: Mapping[str, str] | None = None, idempotency_key: str = "") -> pb.AddBundleHeader:
    """The first message of an AddBundle: every file's sha256 and size (each file is read once here)."""
    specs = [pb.BundleFile(path=path, sha256=_sha256(source), size_bytes=_size(source),
                           media_type=(media_types or {}).get(path) or media_type_of(path))
             for path, source in files.items()]
    return pb.AddBundleHeader(
        parent=f"contexts/{context_id}", bundle_name=bundle_name, tags=dict(tags or {}),
        values={k: value_to_proto(v) for k, v in (values or {}).items()}, lineage=lineage,
        files=specs, commit=commit, idempotency_key=idempotency_key)


def download_targets(bundle: pb.Bundle, destination: Path, store: str) -> dict[str, Path]:
    """Each of ``bundle``'s paths and where it lands under ``destination``, checked before anything is
    written (see :meth:`BundleStoreClient.download`). Raises: DataLoss naming the unsafe paths."""
    paths = [entry.path for entry in bundle.files]
    problems = [rule for _, rule in path_violations(paths)]
    targets = {}
    for index, path in enumerate(paths):
        target = contained(destination, path)
        if target is None:
            problems.append(f"files[{index}].path {path!r} resolves outside {str(destination)!r}")
        targets[path] = target
    if problems:
        raise DataLoss(f"refusing to write bundle {bundle.bundle_name!r} ({bundle.uuid}) under "
                       f"{str(destination)!r}: the bundle-store at {store} named unsafe paths: "
                       + "; ".join(problems[:5]))
    return targets


def open_inside(root: Path, path: str):
    """Open ``root/path`` for writing, creating its directories, never through a symlink: each
    level is opened relative to the one before with ``O_NOFOLLOW``, so a symlink planted after
    the check still cannot redirect the write (``path`` was checked: relative, no '..')."""
    segments = path.split("/")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    directory = os.open(root, flags)
    try:
        for segment in segments[:-1]:
            try:
                os.mkdir(segment, dir_fd=directory)
            except FileExistsError:
                pass
            try:
                child = os.open(segment, flags, dir_fd=directory)
            except OSError as exc:
                raise DataLoss(f"refusing to write {path!r} under {str(root)!r}: {segment!r} is not a "
                               f"directory there (a symlink or a file): {exc.strerror}") from None
            os.close(directory)
            directory = child
        try:
            fd = os.open(segments[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644,
                         dir_fd=directory)
        except OSError as exc:
            raise DataLoss(f"refusing to write {path!r} under {str(root)!r}: {exc.strerror} "
                           "(a symlink or a directory is in the way)") from None
    finally:
        os.close(directory)
    return os.fdopen(fd, "wb")


def _chunks(source: FileSource) -> Iterator[bytes]:
    if isinstance(source, bytes):
        for start in range(0, len(source), CHUNK_BYTES):
            yield source[start:start + CHUNK_BYTES]
        return
    with open(source, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk


def _sha256(source: FileSource) -> str:
    digest = hashlib.sha256()
    for chunk in _chunks(source):
        digest.update(chunk)
    return digest.hexdigest()


def _size(source: FileSource) -> int:
    return len(source) if isinstance(source, bytes) else source.stat().st_size
