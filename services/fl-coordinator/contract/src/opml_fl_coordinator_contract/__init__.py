"""The fl-coordinator's contract: what operators, other services and federation members need.

Its gRPC clients (``FederationClient`` for operators; ``FederatedClient`` and ``run_client`` for a
member, which is a ``NumPyClient``, or a ``KerasClient`` from :mod:`.keras_client`), a model's weights
and how they travel in chunks, federation resource names, the client-token header, the federations
topic and its event source. ``KerasClient`` is not re-exported here: its module is imported only by
members that train with Keras.
"""

from opml_fl_coordinator_contract.client import (
    ClientRun,
    FederatedClient,
    FederationClient,
    NumPyClient,
    run_client,
)
from opml_fl_coordinator_contract.names import CLIENT_TOKEN_HEADER, EVENT_SOURCE, SERVICE, federation_name
from opml_fl_coordinator_contract.topics import FEDERATIONS
from opml_fl_coordinator_contract.weights import ArrayAssembler, Weights, chunks

__all__ = ["CLIENT_TOKEN_HEADER", "EVENT_SOURCE", "FEDERATIONS", "SERVICE", "ArrayAssembler", "ClientRun",
           "FederatedClient", "FederationClient", "NumPyClient", "Weights", "chunks", "federation_name", "run_client"]
