"""The fl-coordinator's contract: what operators, other services and federation members need.

Its gRPC clients (``FederationClient`` for operators; ``FederatedClient`` and ``run_client`` for a
member, which is a ``NumPyClient``, or a ``KerasClient`` from :mod:`.keras_client`), a model's weights
and how they travel in chunks, federation resource names, the client-token header, the federations
topic and its event source. ``KerasClient`` is not re-exported here: its module is imported only by
members that train with Keras.
"""

from opml_common.lazy import lazy_exports

# Imported on first use: a core or a traced job that needs only names or topics stays free of the
# client's grpc (and whatever else a submodule needs).
_EXPORTS = {
    "ArrayAssembler": "weights",
    "CLIENT_TOKEN_HEADER": "names",
    "ClientRun": "client",
    "EVENT_SOURCE": "names",
    "FEDERATIONS": "topics",
    "FederatedClient": "client",
    "FederationClient": "client",
    "NumPyClient": "client",
    "SERVICE": "names",
    "Weights": "weights",
    "chunks": "weights",
    "federation_name": "names",
    "run_client": "client",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
