"""Transport-free core of the bundle store (after Intuit's Disdat): no grpc imported here.

The gRPC servicer converts messages to and from these dataclasses and calls :class:`BundleStore`
(sync, thread-safe; run it with ``asyncio.to_thread``), which announces its changes itself.

Modules: ``store`` (the facade: opening a home, contexts, reads, commit, delete), ``context``
(one context's index and locks), ``writer`` (adding a bundle), ``sync`` (push and pull),
``gc``, ``lineage``, ``events`` (the domain events), ``manifest`` (the dataclasses and their JSON),
``signing`` (the keys that sign and verify remote manifests),
``rules`` (what an input must be), ``remote_url`` (``s3://bucket/prefix``), ``convert`` (to and from
the protobuf messages), ``layout``, ``remote`` and ``transfer`` (disk and S3). A typed value and the
rules of a bundle's file paths are the contract's (``opml_bundle_store_contract``): clients use them too.
"""

from opml_bundle_store.core.manifest import (
    Bundle,
    ContextInfo,
    FileEntry,
    GcReport,
    Lineage,
    LineageGraph,
    TransferProgress,
    compute_content_hash,
)
from opml_bundle_store.core.remote_url import format_remote_url, parse_remote_url
from opml_bundle_store.core.rules import validate_bundle_name, validate_context_id
from opml_bundle_store.core.store import BundleStore
from opml_bundle_store.core.writer import BundleWriter

__all__ = [
    "Bundle",
    "BundleStore",
    "BundleWriter",
    "ContextInfo",
    "FileEntry",
    "GcReport",
    "Lineage",
    "LineageGraph",
    "TransferProgress",
    "compute_content_hash",
    "format_remote_url",
    "parse_remote_url",
    "validate_bundle_name",
    "validate_context_id",
]
