"""Python clients of the fl-coordinator: :class:`FederationClient` for operators (the CLI), and the
client SDK for the federation's members: a member is a :class:`NumPyClient` (Flower's shape:
``get_weights``, ``fit``, ``evaluate``) handed to :func:`run_client`, which joins, pulls tasks,
streams weights in chunks both ways, and reports failures, until the federation ends.

A member, in a dozen lines::

    class Plant(NumPyClient):
        def num_examples(self):
            return len(x)
        def get_weights(self, config):
            return model.get_weights()
        def fit(self, weights, config):
            model.set_weights(weights)
            model.fit(x, y, epochs=int(config["epochs"]), verbose=0)
            return model.get_weights(), len(x), {}
        def evaluate(self, weights, config):
            model.set_weights(weights)
            loss, accuracy = model.evaluate(x_val, y_val, verbose=0)
            return loss, len(x_val), {"accuracy": accuracy}

    run_client("coordinator:50057", "plants", os.environ["OPML_FL_CLIENT_TOKEN"], Plant())

(:class:`~opml_fl_coordinator_contract.keras_client.KerasClient` is that class, FedProx term included.)
Failed calls raise domain errors, never ``grpc.RpcError``.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from opml.fl.v1 import fl_pb2 as pb
from opml.fl.v1 import fl_pb2_grpc

from opml_common.errors import OpmlError
from opml_common.grpc.client import ServiceClient, Tls, pages
from opml_common.retry import Backoff
from opml_fl_coordinator_contract.names import CLIENT_TOKEN_HEADER, federation_name
from opml_fl_coordinator_contract.weights import MAX_ARRAYS, ArrayAssembler, Weights, chunks

log = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
MAX_MODEL_BYTES = 1 << 31


class FederationClient(ServiceClient):
    """One method per FederationService RPC."""

    stub_class = fl_pb2_grpc.FederationServiceStub

    def create(self, config_yaml: str) -> pb.Federation:
        return self.stub.CreateFederation(pb.CreateFederationRequest(config_yaml=config_yaml))

    def get(self, federation: str) -> pb.Federation:
        return self.stub.GetFederation(pb.GetFederationRequest(name=federation_name(federation)))

    def list(self) -> list[pb.Federation]:
        return list(pages(lambda token: self.stub.ListFederations(pb.ListFederationsRequest(page_token=token)),
                          lambda reply: reply.federations))

    def stop(self, federation: str) -> pb.Federation:
        return self.stub.StopFederation(pb.StopFederationRequest(name=federation_name(federation)))

    def rounds(self, federation: str, *, page_size: int = 0) -> list[pb.Round]:
        parent = federation_name(federation)
        return list(pages(lambda token: self.stub.ListRounds(pb.ListRoundsRequest(
            parent=parent, page_size=page_size, page_token=token)), lambda reply: reply.rounds))

    def watch(self, federation: str) -> Iterator[pb.Round]:
        """Completed rounds so far, then each as it completes, until the federation ends."""
        return self.stub.WatchRounds(pb.WatchRoundsRequest(parent=federation_name(federation)))

    def register_client(self, federation: str, client_id: str, labels: Mapping[str, str] | None = None
                        ) -> pb.ClientCredential:
        return self.stub.RegisterClient(pb.RegisterClientRequest(parent=federation_name(federation),
                                                                 client_id=client_id, labels=dict(labels or {})))

    def weights(self, federation: str) -> Weights:
        """The federation's current global model."""
        stream = self.stub.DownloadWeights(pb.DownloadWeightsRequest(name=federation_name(federation)))
        return _weights_by_index(stream)


def _weights_by_index(stream: Iterator[pb.ArrayChunk], *, max_bytes: int = MAX_MODEL_BYTES) -> Weights:
    """Arrays from chunks that come array after array (DownloadWeights sends no count first), bounded
    as a task's are: at most ``MAX_ARRAYS`` arrays and ``max_bytes`` in all, in order, numeric dtypes.

    Raises: InvalidArgument: the stream breaks a bound (see :class:`ArrayAssembler`)."""
    assembler = ArrayAssembler(MAX_ARRAYS, max_bytes=max_bytes, floating_only=False)
    for chunk in stream:
        assembler.add(chunk)
    return assembler.received()


class NumPyClient(ABC):
    """A federation member, as Flower's NumPyClient: weights are lists of numpy arrays."""

    @abstractmethod
    def num_examples(self) -> int:
        """How many examples the member trains on (its local dataset's size), declared when it
        joins: each update may claim at most this many times the round's epochs."""

    @abstractmethod
    def get_weights(self, config: dict[str, float]) -> Weights:
        """The member's starting weights (asked once, when the federation has no model yet)."""

    @abstractmethod
    def fit(self, weights: Weights, config: dict[str, float]) -> tuple[Weights, int, dict[str, float]]:
        """Train from ``weights`` on local data; returns (new weights, examples processed: at most
        ``num_examples()`` times ``config["epochs"]``, metrics).
        ``config`` holds epochs, batch_size, learning_rate, server_round, and, as the strategy
        says, proximal_mu (FedProx) and time_budget_s (send partial work by then).

        Raises:
            Exception: any failure; the runner reports it and the round goes on without it.
        """

    def evaluate(self, weights: Weights, config: dict[str, float]) -> tuple[float, int, dict[str, float]] | None:
        """(loss, examples, metrics with ``accuracy``) of ``weights`` on local validation data, or
        None. Its accuracy is reported as ``eval_accuracy`` with each update (TiFL's per-tier accuracy)."""
        return None


@dataclass
class ClientRun:
    """What :func:`run_client` did."""

    tasks: int = 0
    accepted: int = 0
    rejected: list[str] = None  # type: ignore[assignment]
    failures: int = 0

    def __post_init__(self) -> None:
        self.rejected = []


class FederatedClient(ServiceClient):
    """The FederatedClientService, with the member's own token on every call."""

    stub_class = fl_pb2_grpc.FederatedClientServiceStub

    def __init__(self, target: str, federation: str, client_token: str, *, token: str | None = None,
                 tls: Tls = None, chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__(target, token=token, tls=tls)
        self.federation = federation_name(federation)
        self._metadata = ((CLIENT_TOKEN_HEADER, client_token),)
        self.chunk_bytes = chunk_bytes

    def join(self, num_examples: int) -> pb.JoinResponse:
        """Join, declaring the examples the member trains on; uploads then use chunks no larger
        than the coordinator accepts."""
        reply = self.stub.Join(pb.JoinRequest(federation=self.federation, num_examples=num_examples),
                               metadata=self._metadata)
        if reply.chunk_bytes:
            self.chunk_bytes = min(self.chunk_bytes, reply.chunk_bytes)
        return reply

    def leave(self) -> None:
        self.stub.Leave(pb.LeaveRequest(federation=self.federation), metadata=self._metadata)

    def pull(self, wait_s: float = 10.0) -> tuple[pb.TaskHeader, Weights] | None:
        """The next task's header and model, or None when there was none within ``wait_s``."""
        stream = self.stub.PullTask(pb.PullTaskRequest(federation=self.federation, wait_seconds=wait_s),
                                    metadata=self._metadata, timeout=wait_s + 30)
        header = None
        assembler = None
        for message in stream:
            if message.HasField("header"):
                header = message.header
                if header.num_arrays:
                    assembler = ArrayAssembler(header.num_arrays, max_bytes=MAX_MODEL_BYTES, floating_only=False)
            elif assembler is not None:
                assembler.add(message.chunk)
        if header is None:
            return None
        return header, (assembler.result() if assembler is not None else [])

    def upload(self, task_id: int, weights: Weights, num_examples: int, metrics: Mapping[str, float]
               ) -> pb.UploadUpdateResponse:
        header = pb.UpdateHeader(federation=self.federation, task_id=task_id, num_examples=num_examples,
                                 metrics=dict(metrics), num_arrays=len(weights))

        def messages() -> Iterator[pb.UpdateChunk]:
            yield pb.UpdateChunk(header=header)
            for chunk in chunks(weights, self.chunk_bytes):
                yield pb.UpdateChunk(chunk=chunk)

        return self.stub.UploadUpdate(messages(), metadata=self._metadata)

    def report_failure(self, task_id: int, reason: str) -> None:
        self.stub.ReportFailure(pb.ReportFailureRequest(federation=self.federation, task_id=task_id,
                                                        reason=reason[:200]), metadata=self._metadata)


def run_client(target: str, federation: str, client_token: str, client: NumPyClient, *, token: str | None = None,
               tls: Tls = None, wait_s: float = 10.0, chunk_bytes: int = CHUNK_BYTES,
               reconnect_for_s: float = 120.0) -> ClientRun:
    """Take part in ``federation`` until it ends; returns what was done. While the coordinator
    cannot be reached (it restarts), keep trying with capped backoff for up to ``reconnect_for_s``
    seconds, then join again: a restarted coordinator continues from its last completed round.

    Raises:
        OpmlError: the coordinator refused the member (Unauthenticated, PermissionDenied...), or
            stayed unreachable longer than ``reconnect_for_s``.
    """
    run = ClientRun()
    backoff = Backoff(base_s=0.2, multiplier=2.0, max_s=2.0)
    with FederatedClient(target, federation, client_token, token=token, tls=tls, chunk_bytes=chunk_bytes) as member:
        failed_since: float | None = None
        retries = 0
        while True:
            try:
                member.join(int(client.num_examples()))
                if _take_part(member, client, run, wait_s):
                    return run
            except OpmlError as error:
                if not error.retriable:
                    raise
                now = time.monotonic()
                failed_since = failed_since if failed_since is not None else now
                if now - failed_since > reconnect_for_s:
                    raise
                log.info("coordinator unreachable (%s); retrying", error.message[:200])
                time.sleep(backoff.delay(retries))
                retries += 1
                continue
            failed_since, retries = None, 0


def _take_part(member: FederatedClient, client: NumPyClient, run: ClientRun, wait_s: float) -> bool:
    """Pull and do tasks until the federation ends (True)."""
    while True:
        pulled = member.pull(wait_s)
        if pulled is None:
            continue
        header, weights = pulled
        config = dict(header.config)
        if header.kind == pb.TASK_KIND_DONE:
            return True
        run.tasks += 1
        try:
            if header.kind == pb.TASK_KIND_INIT:
                update, examples, metrics = client.get_weights(config), 0, {}
            else:
                metrics = {}
                evaluated = client.evaluate(weights, config)
                if evaluated is not None and "accuracy" in evaluated[2]:
                    metrics["eval_accuracy"] = float(evaluated[2]["accuracy"])
                update, examples, fit_metrics = client.fit(weights, config)
                metrics.update({k: float(v) for k, v in fit_metrics.items()})
        except Exception as error:  # the member's own failure: say so, keep taking part
            run.failures += 1
            log.warning("task %d failed: %s", header.task_id, error)
            member.report_failure(header.task_id, f"{type(error).__name__}: {error}")
            continue
        unfit = sorted(k for k, v in metrics.items() if not math.isfinite(v))
        if unfit:  # older coordinators refused the whole upload for one (a diverged loss, no accuracy compiled)
            log.warning("task %d: metrics %s are not finite and are left out", header.task_id, unfit)
        reply = member.upload(header.task_id, [np.asarray(w) for w in update], int(examples),
                              {k: v for k, v in metrics.items() if k not in unfit})
        if reply.accepted:
            run.accepted += 1
        else:
            run.rejected.append(reply.reason)
            log.warning("update of task %d rejected: %s", header.task_id, reply.reason)


__all__ = ["ClientRun", "FederatedClient", "FederationClient", "NumPyClient", "OpmlError", "run_client"]
