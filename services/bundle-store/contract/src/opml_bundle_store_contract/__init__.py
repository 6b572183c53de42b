"""The bundle-store's contract: what other services and users need to store and read bundles.

Its gRPC client, a bundle's typed values and their message, the rules of a bundle's file paths
(which a client applies before it writes a bundle to disk), the bundles topic and its event source.

The client (grpc) is imported on first use: the store's transport-free core imports this package
for the values and the path rules, and stays free of grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opml_bundle_store_contract.names import EVENT_SOURCE, SERVICE
from opml_bundle_store_contract.paths import contained, path_violations, validate_bundle_path, validate_bundle_paths
from opml_bundle_store_contract.topics import BUNDLES
from opml_bundle_store_contract.values import Value, value_from_proto, value_to_proto

if TYPE_CHECKING:
    from opml_bundle_store_contract.client import BundleStoreClient, files_from_paths, media_type_of

_CLIENT_NAMES = frozenset({"BundleStoreClient", "files_from_paths", "media_type_of"})

__all__ = ["BUNDLES", "EVENT_SOURCE", "SERVICE", "BundleStoreClient", "Value", "contained", "files_from_paths",
           "media_type_of", "path_violations", "validate_bundle_path", "validate_bundle_paths", "value_from_proto",
           "value_to_proto"]


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from opml_bundle_store_contract import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
