"""The bundle-store's contract: what other services and users need to store and read bundles.

Its gRPC clients (blocking, and asyncio for a service's event loop), a bundle's typed values and
their message, the rules of a bundle's file paths (which a client applies before it writes a bundle
to disk), the bundles topic and its event source.
"""

from opml_common.lazy import lazy_exports

# Imported on first use: a core or a traced job that needs only names or topics stays free of the
# client's grpc (and whatever else a submodule needs).
_EXPORTS = {
    "AsyncBundleStoreClient": "aioclient",
    "BUNDLES": "topics",
    "BundleStoreClient": "client",
    "EVENT_SOURCE": "names",
    "SERVICE": "names",
    "Value": "values",
    "contained": "paths",
    "files_from_paths": "client",
    "media_type_of": "client",
    "path_violations": "paths",
    "validate_bundle_path": "paths",
    "validate_bundle_paths": "paths",
    "value_from_proto": "values",
    "value_to_proto": "values",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
