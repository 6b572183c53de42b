"""The control plane's calls to one worker: load (optionally profiling), unload, read a profile.

The worker's repository extension (``RepositoryModelLoad``/``Unload``, ``ModelConfig``) over
grpc.aio with the router's bearer token; failures come back as the worker's domain errors (an
ONNX file onnxruntime refuses: ``InvalidArgument`` with onnxruntime's reason; no room:
``ResourceExhausted``), so the deploy logic never sees a ``grpc.RpcError``.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_common.errors import DeadlineExceeded, OpmlError, Unavailable
from opml_common.grpc.client import domain_error, open_aio_channel
from opml_inference_router.placement import Profile, SessionChoice

LOAD_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 10.0


class WorkerClient:
    """Admin calls to the worker at ``address`` (host:port). ``close()`` releases the channel."""

    def __init__(self, address: str, *, token: str | None = None) -> None:
        self.address = address
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel = open_aio_channel(address, options=[])  # TLS as OPML_GRPC_TLS_* says
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def load(self, model: str, *, path: Path, version: int, precision: str | None = None,
                   profile: bool = False, instances: int | None = None, max_batch: int | None = None,
                   session: SessionChoice | None = None) -> None:
        """Loads ``version`` of the bundle at ``path`` as ``instances`` sessions batching up to
        ``max_batch`` rows, with ``session``'s options (threads 0: the worker's); returns once it
        serves. On a version loaded there in the same precision and options, ``instances`` and
        ``max_batch`` change in place (no reload); other options reload it.

        Raises: what the worker's repository raises (InvalidArgument, NotFound, FailedPrecondition,
        ResourceExhausted), or Unavailable when the worker cannot be reached.
        """
        request = pb.RepositoryModelLoadRequest(model_name=model)
        request.parameters["path"].string_param = str(path)
        request.parameters["version"].int64_param = version
        if precision:
            request.parameters["precision"].string_param = precision
        if profile:
            request.parameters["profile"].bool_param = True
        if instances:
            request.parameters["instances"].int64_param = instances
        if max_batch:
            request.parameters["max_batch"].int64_param = max_batch
        if session is not None:
            if session.threads:
                request.parameters["threads"].int64_param = session.threads
            request.parameters["opt_level"].string_param = session.opt_level
            request.parameters["execution_mode"].string_param = session.execution_mode
        await self._call(self._stub.RepositoryModelLoad, request, LOAD_TIMEOUT_S)

    async def unload(self, model: str, version: int) -> None:
        """Raises: NotFound (not loaded there), Unavailable."""
        request = pb.RepositoryModelUnloadRequest(model_name=model)
        request.parameters["version"].int64_param = version
        await self._call(self._stub.RepositoryModelUnload, request, LOAD_TIMEOUT_S)

    async def profile(self, model: str, version: int) -> Profile:
        """The profile measured when ``version`` was loaded with ``profile``.

        Raises: NotFound, Unavailable, FailedPrecondition (the load did not profile).
        """
        reply = await self._call(self._stub.ModelConfig,
                                 pb.ModelConfigRequest(name=model, version=str(version)), CALL_TIMEOUT_S)
        parameter = reply.config.parameters.get("opml_profile")
        if parameter is None:
            raise OpmlError(f"worker {self.address} reports no profile of {model} v{version}")
        return Profile.from_dict(json.loads(parameter.string_value))

    async def loaded(self) -> set[tuple[str, int]]:
        """The (model, version) pairs loaded on the worker (its repository index). Raises: Unavailable."""
        reply = await self._call(self._stub.RepositoryIndex, pb.RepositoryIndexRequest(), CALL_TIMEOUT_S)
        return {(model.name, int(model.version)) for model in reply.models if model.version.isdigit()}

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method, request, timeout_s: float):
        try:
            return await method(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            failure = domain_error(error)
            # a worker that does not answer its admin call in time is taken for one that is down
            if isinstance(failure, (Unavailable, DeadlineExceeded)) or error.code() == grpc.StatusCode.CANCELLED:
                raise Unavailable(f"worker {self.address}: {error.details() or error.code().name}") from None
            raise failure from None
