"""The worker's KServe v2 ``inference.GRPCInferenceService``: the Open Inference Protocol plus Triton's
model-repository and statistics extensions, over the transport-free :class:`ModelRepository`.

It only converts messages; domain errors become status codes in the shared interceptor (unknown
model or version: NOT_FOUND; a bad tensor: INVALID_ARGUMENT naming it; no room: RESOURCE_EXHAUSTED).
Methods it does not implement (shared memory, streaming, trace and log settings) answer UNIMPLEMENTED.
Load parameters: ``path`` (bundle directory), ``version`` (of a flat bundle, or the one version to
load), ``precision``, ``profile`` (measure before serving; the profile is in ModelConfig's
``parameters["opml_profile"]``), ``instances`` (sessions of the version, Triton's instance_group
count; one slot each) and ``max_batch`` (the batcher's cap) - on a version loaded in the same
precision these two change in place, without a reload; ``threads``, ``opt_level`` and
``execution_mode`` (the sessions' options: the serving configuration the router chose; ModelConfig's
``opml_threads``, ``opml_opt_level``, ``opml_execution_mode`` read them back from onnxruntime);
or Triton's ``config`` (the ModelConfig as JSON) with
``file:<path>`` contents, so ``tritonclient``'s ``load_model(config=..., files=...)`` ships a bundle
to a worker that shares no disk with its caller.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_common.errors import InvalidArgument, NotFound
from opml_inference_router.kserve import decode_inputs, encode_response, expected_shape, kserve_name
from opml_inference_router.runtime import ModelRepository, Served, to_profile
from opml_inference_router.runtime.bundle import write_bundle

PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ["model_repository", "statistics", "model_configuration"]
_LOAD_PARAMETERS = {"path": "string_param", "version": "int64_param", "precision": "string_param",
                    "profile": "bool_param", "config": "string_param", "instances": "int64_param",
                    "max_batch": "int64_param", "threads": "int64_param", "opt_level": "string_param",
                    "execution_mode": "string_param"}
_FILE_PREFIX = "file:"
_DECODE_IN_THREAD_BYTES = 1 << 20
_DECODE_IN_THREAD_VALUES = 1 << 16


def _costly(request: pb.ModelInferRequest) -> bool:
    """Whether decoding may take long enough (a BYTES walk, typed contents converted one by one) to
    be worth a thread hop: more than 1 MiB raw, or more than 65,536 typed values in a tensor. O(inputs);
    O(1) for a message of at most 65,536 bytes (every value takes a byte at least), the common case."""
    if request.ByteSize() <= _DECODE_IN_THREAD_VALUES:
        return False
    if any(len(raw) > _DECODE_IN_THREAD_BYTES for raw in request.raw_input_contents):
        return True
    return any(len(getattr(tensor.contents, field)) > _DECODE_IN_THREAD_VALUES
               for tensor in request.inputs if tensor.HasField("contents")
               for field in _CONTENT_FIELDS)


_CONTENT_FIELDS = ("bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents",
                   "fp32_contents", "fp64_contents", "bytes_contents")
# tritonclient's unload_model always sends unload_dependents; a worker hosts no ensembles, so it is moot.
_UNLOAD_PARAMETERS = {"version": "int64_param", "unload_dependents": "bool_param"}


def _parameters(parameters, allowed: dict[str, str]) -> dict[str, object]:
    """Load/unload parameters by name, each of its expected kind.

    Raises:
        InvalidArgument: an unknown parameter, or one of the wrong kind.
    """
    values: dict[str, object] = {}
    for key, parameter in parameters.items():
        kind = "bytes_param" if key.startswith(_FILE_PREFIX) and "config" in allowed else allowed.get(key)
        if kind is None:
            raise InvalidArgument(f"parameters[{key}]", f"is not a parameter; use {', '.join(allowed)}"
                                                        f"{' or file:<path>' if 'config' in allowed else ''}")
        if parameter.WhichOneof("parameter_choice") != kind:
            raise InvalidArgument(f"parameters[{key}]", f"must be a {kind}, but got "
                                                        f"{parameter.WhichOneof('parameter_choice')}")
        values[key] = getattr(parameter, kind)
    for key in ("version", "instances", "max_batch", "threads"):
        if key in values and int(values[key]) < 1:  # type: ignore[call-overload]
            raise InvalidArgument(f"parameters[{key}]", f"must be >= 1, but got {values[key]}")
    return values


def _triton_type(config_type: str) -> int:
    return mc.DataType.Value("TYPE_STRING" if config_type == "string" else f"TYPE_{config_type.upper()}")


class WorkerServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, repository: ModelRepository, *, server_name: str, server_version: str,
                 scratch: Path | None = None) -> None:
        self._repository = repository
        self._scratch = scratch or Path(tempfile.gettempdir())
        self._server_name = server_name
        self._server_version = server_version

    # -- health and metadata ---------------------------------------------------------------------

    async def ServerLive(self, request: pb.ServerLiveRequest, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request: pb.ModelReadyRequest, context) -> pb.ModelReadyResponse:
        try:
            self._repository.get(request.name, request.version)
        except (NotFound, InvalidArgument):
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=self._server_name, version=self._server_version, extensions=EXTENSIONS)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context) -> pb.ModelMetadataResponse:
        config = self._repository.get(request.name, request.version).replica.config
        response = pb.ModelMetadataResponse(name=config.name, platform=PLATFORM,
                                            versions=[str(v) for v in self._repository.versions(config.name)])
        for specs, tensors in ((config.inputs, response.inputs), (config.outputs, response.outputs)):
            for spec in specs:
                tensors.add(name=spec.name, datatype=kserve_name(spec.data_type),
                            shape=expected_shape(spec, config))
        return response

    async def ModelConfig(self, request: pb.ModelConfigRequest, context) -> pb.ModelConfigResponse:
        served = self._repository.get(request.name, request.version)
        replica, config = served.replica, served.replica.config
        triton = mc.ModelConfig(name=config.name, platform=PLATFORM, backend="onnxruntime",
                                max_batch_size=replica.max_batch if replica.batches else 0)
        for spec in config.inputs:
            triton.input.add(name=spec.name, data_type=_triton_type(spec.data_type), dims=spec.dims)
        for spec in config.outputs:
            triton.output.add(name=spec.name, data_type=_triton_type(spec.data_type), dims=spec.dims)
        if config.dynamic_batching is not None:
            triton.dynamic_batching.max_queue_delay_microseconds = config.dynamic_batching.max_queue_delay_us
            triton.dynamic_batching.preferred_batch_size.extend(
                s for s in replica.kind.batch_sizes if s <= replica.max_batch)
        gpu = replica.kind.execution_provider == "CUDAExecutionProvider"
        triton.instance_group.add(count=served.instances, kind=mc.ModelInstanceGroup.KIND_GPU if gpu
                                  else mc.ModelInstanceGroup.KIND_CPU)
        settings = replica.settings  # as onnxruntime reports the session's options
        extra = {"opml_pool_kind": replica.kind.name, "opml_precision": replica.precision,
                 "opml_memory_mib": f"{served.memory_mib:.3f}", "opml_batch_cap": str(served.batcher.max_batch),
                 "opml_threads": str(settings.threads), "opml_opt_level": settings.opt_level,
                 "opml_execution_mode": settings.execution_mode}
        if served.profile is not None:
            extra["opml_profile"] = json.dumps({**to_profile(served.profile).to_dict(),
                                                "timings": served.profile.to_dict()["timings"]})
        for key, value in extra.items():
            triton.parameters[key].string_value = value
        return pb.ModelConfigResponse(config=triton)

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context) -> pb.ModelStatisticsResponse:
        if request.name:
            chosen = [self._repository.get(request.name, request.version)]
        else:
            chosen = [self._repository.get(entry.name, entry.version)
                      for entry in self._repository.index() if entry.state == "READY"]
        response = pb.ModelStatisticsResponse()
        for served in chosen:
            response.model_stats.append(_statistics(served))
        return response

    # -- inference -------------------------------------------------------------------------------

    async def ModelInfer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        served = self._repository.get(request.model_name, request.model_version)
        replica = served.replica
        if _costly(request):  # decoded in a thread: the loop keeps serving the co-hosted models meanwhile
            inputs = await asyncio.to_thread(decode_inputs, request, replica.config, max_batch=replica.max_batch)
        else:
            inputs = decode_inputs(request, replica.config, max_batch=replica.max_batch)
        outputs = await served.batcher.infer(inputs)
        return encode_response(request, replica.config, replica.model.version, outputs)

    def infer_now(self, requests: list[pb.ModelInferRequest]) -> list[pb.ModelInferResponse | Exception] | None:
        """ModelInfer of requests that arrived together, answered at once on the event loop's thread as one
        batch, when they are for one replica, it is idle and its runs are short, and they fit one batch
        (:meth:`DynamicBatcher.run_now`); None when they must queue (``ModelInfer`` serves them). A request
        whose tensors are wrong gets its error in its place; the others run.

        Raises:
            NotFound, InvalidArgument: (one request) what ``ModelInfer`` raises for it.
        """
        served = self._repository.get(requests[0].model_name, requests[0].model_version)
        batcher = served.batcher
        if not batcher.can_run_now() or any(_costly(request) for request in requests):
            return None
        for request in requests[1:]:
            if self._repository.get(request.model_name, request.model_version) is not served:
                return None
        replica = served.replica
        answers: list[pb.ModelInferResponse | Exception | None] = [None] * len(requests)
        runs: list[int] = []
        batch: list[dict[str, np.ndarray]] = []
        for index, request in enumerate(requests):
            try:
                batch.append(decode_inputs(request, replica.config, max_batch=replica.max_batch))
                runs.append(index)
            except InvalidArgument as exc:
                if len(requests) == 1:
                    raise
                answers[index] = exc
        if batch:
            if not batcher.fits_one_batch(batch):
                return None
            for index, outputs in zip(runs, batcher.run_now(batch), strict=True):
                answers[index] = encode_response(requests[index], replica.config, replica.model.version, outputs)
        return answers  # type: ignore[return-value]

    # -- repository extension --------------------------------------------------------------------

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context) -> pb.RepositoryIndexResponse:
        response = pb.RepositoryIndexResponse()
        for entry in self._repository.index():
            if request.ready and entry.state != "READY":
                continue
            response.models.add(name=entry.name, version=entry.version, state=entry.state, reason=entry.reason)
        return response

    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context) -> pb.RepositoryModelLoadResponse:
        if not request.model_name:
            raise InvalidArgument("model_name", "is required")
        values = _parameters(request.parameters, _LOAD_PARAMETERS)
        files = {key[len(_FILE_PREFIX):]: value for key, value in values.items() if key.startswith(_FILE_PREFIX)}
        if not files and "config" not in values:
            await self._load(request.model_name, values, values.get("path") or None)
            return pb.RepositoryModelLoadResponse()
        if not files or "config" not in values:
            raise InvalidArgument("parameters[config]", "and file:<path> parameters must come together")
        sent = self._scratch / f"opml-load-{uuid.uuid4().hex}"  # never a path built from the caller's name
        try:  # the sessions are built from bytes in memory: the files are not needed once loaded
            write_bundle(sent, config_json=str(values["config"]), files=files)  # type: ignore[arg-type]
            await self._load(request.model_name, values, sent)
        finally:
            shutil.rmtree(sent, ignore_errors=True)
        return pb.RepositoryModelLoadResponse()

    async def _load(self, name: str, values: dict[str, object], path: object) -> None:
        await self._repository.load(
            name, path=path,  # type: ignore[arg-type]
            version=values.get("version"), precision=values.get("precision") or None,  # type: ignore[arg-type]
            profile=bool(values.get("profile", False)), instances=values.get("instances"),  # type: ignore[arg-type]
            max_batch=values.get("max_batch"), threads=values.get("threads"),  # type: ignore[arg-type]
            opt_level=values.get("opt_level") or None,  # type: ignore[arg-type]
            execution_mode=values.get("execution_mode") or None)  # type: ignore[arg-type]

    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context) -> pb.RepositoryModelUnloadResponse:
        values = _parameters(request.parameters, _UNLOAD_PARAMETERS)
        await self._repository.unload(request.model_name, values.get("version"))  # type: ignore[arg-type]
        return pb.RepositoryModelUnloadResponse()


def _statistics(served: Served) -> pb.ModelStatistics:
    """Triton's ModelStatistics of one replica: inference vs execution counts show batching at work."""
    counts = served.batcher.metrics
    stats = pb.ModelStatistics(name=served.replica.model.name, version=str(served.replica.model.version),
                               last_inference=counts.last_inference_ms, inference_count=counts.inference_count,
                               execution_count=counts.execution_count)
    stats.inference_stats.success.count = counts.inference_count
    stats.inference_stats.success.ns = counts.success_ns
    stats.inference_stats.fail.count = counts.failures
    for size, batch in sorted(counts.batches.items()):
        stats.batch_stats.add(batch_size=size, compute_infer=pb.StatisticDuration(count=batch.count, ns=batch.ns))
    device = "GPU" if served.replica.kind.execution_provider == "CUDAExecutionProvider" else "CPU"
    stats.memory_usage.add(type=device, id=0, byte_size=int(served.memory_mib * 1024 * 1024))
    return stats
