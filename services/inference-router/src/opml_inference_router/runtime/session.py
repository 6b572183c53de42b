"""ONNX Runtime sessions built from what a pool kind declares, in the precision the kind and model share.

A kind names its execution provider; everything else follows from it: an isolated share of the
worker per replica (intra-op threads = the worker's cores / its slots, one inter-op thread, no
spinning, so replicas do not steal each other's cores: DeepCPU's lesson that small, pinned thread
pools beat one big pool under concurrency), full graph optimizations, and the precision. ``int8``
is ONNX Runtime's quantization done at load time (static QDQ with the bundle's calibration samples
when it carries ``calibration.npz``, else dynamic), ``fp16`` its float16 conversion keeping fp32
inputs and outputs, so clients send the same tensors whatever kind serves them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_inference_router.kserve.datatypes import BY_ONNX
from opml_inference_router.kserve.validation import expected_form, expected_shape
from opml_inference_router.placement.fleet_config import PoolKind
from opml_inference_router_contract.model_config import ModelConfig

CALIBRATION_FILE = "calibration.npz"
CUDA = "CUDAExecutionProvider"
PREFERENCE = ("int8", "fp16", "fp32")
"""Precisions this worker can produce, cheapest first (bf16 needs a converter onnxruntime lacks)."""


def require_provider(kind: PoolKind) -> None:
    """Refuses to host a kind whose execution provider this onnxruntime build lacks (a gpu kind on a
    machine without CUDA), so a misdeclared worker fails at start, not on its first load.

    Raises:
        FailedPrecondition: naming the provider and the ones available.
    """
    available = ort.get_available_providers()
    if kind.execution_provider not in available:
        hint = (" (onnxruntime-gpu has it: install the router's gpu extra, see the README's GPU pools)"
                if kind.execution_provider == CUDA else "")
        raise FailedPrecondition(f"pool kind {kind.name} needs {kind.execution_provider}, which this onnxruntime "
                                 f"build lacks{hint} (available: {', '.join(available)})")


def providers(kind: PoolKind) -> list[str | tuple[str, dict[str, str]]]:
    """The providers a session of ``kind`` asks for: its own only. A CUDA kind's worker is pinned to
    one device by ``CUDA_VISIBLE_DEVICES``, so its device is 0 after the mask."""
    if kind.execution_provider == CUDA:
        return [(CUDA, {"device_id": "0"})]
    return [kind.execution_provider]


def choose_precision(config: ModelConfig, kind: PoolKind, requested: str | None = None) -> str:
    """The cheapest precision the kind runs, the model allows and this worker can produce
    (``requested`` instead when given and possible).

    Raises:
        FailedPrecondition: no common precision, or ``requested`` is not one of them.
    """
    common = [p for p in PREFERENCE if p in kind.precisions and p in config.precisions]
    if requested is not None:
        if requested not in common:
            raise FailedPrecondition(f"precision {requested} is not one that pool kind {kind.name} runs "
                                     f"({', '.join(kind.precisions)}), model {config.name} allows "
                                     f"({', '.join(config.precisions)}) and this worker produces")
        return requested
    if not common:
        raise FailedPrecondition(f"model {config.name} allows {', '.join(config.precisions)}, but pool kind "
                                 f"{kind.name} runs {', '.join(kind.precisions)}")
    return common[0]


def thread_share(kind: PoolKind, cores: int | None = None) -> int:
    """Intra-op threads of one replica: the worker's cores split evenly among the kind's slots."""
    return max(1, (cores or os.cpu_count() or 1) // kind.slots)


OPT_LEVELS = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
EXECUTION_MODES = {"sequential": ort.ExecutionMode.ORT_SEQUENTIAL, "parallel": ort.ExecutionMode.ORT_PARALLEL}


@dataclass(frozen=True)
class SessionSettings:
    """The options of one replica's session: intra-op threads, graph optimization level, execution
    mode. The worker's own are its slot's share of cores, ``all``, ``sequential``; the router may
    load a replica with others (the serving configuration placement chose for it)."""

    threads: int
    opt_level: str = "all"
    execution_mode: str = "sequential"

    @classmethod
    def of(cls, session: ort.InferenceSession) -> SessionSettings:
        """What onnxruntime says ``session`` runs with (read back, not remembered)."""
        options = session.get_session_options()
        level = next(name for name, value in OPT_LEVELS.items() if value == options.graph_optimization_level)
        mode = next(name for name, value in EXECUTION_MODES.items() if value == options.execution_mode)
        return cls(options.intra_op_num_threads, level, mode)


def session_options(kind: PoolKind, *, threads: int, opt_level: str = "all",
                    execution_mode: str = "sequential") -> ort.SessionOptions:
    """The session's options: ``opt_level`` and ``execution_mode`` other than the worker's own (all,
    sequential) are a serving configuration placement chose, or one being measured (performance
    models). Parallel mode gets ``threads`` inter-op threads, since with one it is sequential."""
    options = ort.SessionOptions()
    options.graph_optimization_level = OPT_LEVELS[opt_level]
    options.execution_mode = EXECUTION_MODES[execution_mode]
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = threads if execution_mode == "parallel" else 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    return options


@dataclass(frozen=True)
class _Calibration:
    """Feeds a bundle's calibration samples to static quantization in batches of 32 rows."""

    samples: dict[str, np.ndarray]

    def reader(self):
        from onnxruntime.quantization import CalibrationDataReader

        samples = self.samples

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                rows = len(next(iter(samples.values())))
                self._batches: Iterator[dict[str, np.ndarray]] = iter(
                    [{name: array[start:start + 32] for name, array in samples.items()}
                     for start in range(0, rows, 32)])

            def get_next(self):
                return next(self._batches, None)

        return Reader()


def convert(path: Path, precision: str, config: ModelConfig, *, calibration: Path | None = None) -> bytes:
    """The model at ``path`` as serialized ONNX in ``precision``; int8 is calibrated (static) on the
    ``calibration`` samples (an .npz of arrays by input name) when that file exists, else dynamic.

    Raises:
        InvalidArgument: the file is not ONNX that the converter or quantizer can read (field = path).
    """
    if precision == "fp32":
        return path.read_bytes()
    try:
        model = onnx.load(path)
        if precision == "fp16":
            from onnxruntime.transformers.float16 import convert_float_to_float16

            return convert_float_to_float16(model, keep_io_types=True).SerializeToString()
        return _quantize_int8(model, calibration, config)
    except Exception as error:  # noqa: BLE001 - onnx and the quantizer raise many types; the reason is what matters
        raise InvalidArgument(str(path), f"cannot be converted to {precision}: {error}") from None


def _quantize_int8(model: onnx.ModelProto, calibration: Path | None, config: ModelConfig) -> bytes:
    """ONNX Runtime's recommended path: ONNX shape inference and graph optimization first (quant_pre_process),
    then static QDQ quantization on calibration samples, or dynamic quantization without them."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory(prefix="opml-int8-") as scratch:
        prepared, output = Path(scratch) / "model.prepared.onnx", Path(scratch) / "model.int8.onnx"
        quant_pre_process(model, prepared, skip_symbolic_shape=True)  # symbolic inference needs sympy
        if calibration is not None and calibration.is_file():
            with np.load(calibration) as data:
                samples = {spec.name: data[spec.name] for spec in config.inputs}
            quantize_static(prepared, output, _Calibration(samples).reader(), quant_format=QuantFormat.QDQ,
                            per_channel=True, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
        else:
            quantize_dynamic(prepared, output, weight_type=QuantType.QInt8)
        return output.read_bytes()


EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"
"""onnxruntime's session entry for where a model built from bytes finds its external data (without
it, relative locations resolve against the process's working directory)."""


def build_session(model: bytes, kind: PoolKind, *, threads: int, source: str, folder: Path, opt_level: str = "all",
                  execution_mode: str = "sequential") -> ort.InferenceSession:
    """An InferenceSession on the kind's execution provider (options as :func:`session_options`);
    the model's external data, if any, is read from ``folder`` (the model file's folder, where
    :func:`~.external_data.check_external_data` confined it), never from the working directory.

    The session runs on the kind's provider or is refused: onnxruntime would otherwise put it on the
    CPU (a provider it lacks is only warned about; one that fails to start falls back), and a gpu
    replica silently on the CPU would lie to placement about what it costs and how fast it is.

    Raises:
        InvalidArgument: onnxruntime refuses the model; field = ``source``, message = its reason.
        FailedPrecondition: the session did not get the kind's provider (what it got instead).
    """
    try:
        options = session_options(kind, threads=threads, opt_level=opt_level, execution_mode=execution_mode)
        options.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(folder))
        session = ort.InferenceSession(model, sess_options=options, providers=providers(kind), enable_fallback=0)
    except Exception as error:  # noqa: BLE001 - onnxruntime raises its own pybind types; its reason is what matters
        raise InvalidArgument(source, f"onnxruntime cannot load it: {error}") from None
    check_placed(session.get_providers(), kind)
    return session


def check_placed(placed: list[str], kind: PoolKind) -> None:
    """Raises: FailedPrecondition when a session's providers (``placed``, first the one it prefers)
    do not start with ``kind``'s."""
    if not placed or placed[0] != kind.execution_provider:
        raise FailedPrecondition(f"pool kind {kind.name} runs on {kind.execution_provider}, but onnxruntime "
                                 f"placed the session on {', '.join(placed) or 'nothing'}; refused rather than "
                                 "served on another device than placement counts")


def check_signature(session: ort.InferenceSession, config: ModelConfig) -> None:
    """Refuses a model whose graph does not match its config: the tensors' names, types and ranks,
    and every dim both fix.

    Raises:
        InvalidArgument: field ``inputs[<name>]`` / ``outputs[<name>]``, saying what the graph has.
    """
    for role, declared, actual in (("inputs", config.inputs, session.get_inputs()),
                                   ("outputs", config.outputs, session.get_outputs())):
        graph = {node.name: node for node in actual}
        names = {spec.name for spec in declared}
        for spec in declared:
            node = graph.get(spec.name)
            if node is None:
                raise InvalidArgument(f"{role}[{spec.name}]", f"is not in the ONNX graph, whose {role} are "
                                                              f"{', '.join(graph) or 'none'}")
            datatype = BY_ONNX.get(node.type)
            want = expected_shape(spec, config)
            dims = [d if isinstance(d, int) else -1 for d in node.shape]
            fits = datatype is not None and datatype.config == spec.data_type and len(dims) == len(want) and all(
                w == -1 or d == -1 or w == d for w, d in zip(want, dims))
            if not fits:
                kind = datatype.kserve if datatype else node.type
                raise InvalidArgument(f"{role}[{spec.name}]", f"the config declares {expected_form(spec, config)}, "
                                                              f"but the ONNX graph has {kind} {dims}")
        if role == "inputs":
            undeclared = [name for name in graph if name not in names]
            if undeclared:
                raise InvalidArgument(f"inputs[{undeclared[0]}]", "the ONNX graph needs this input, but the config "
                                                                  "does not declare it")
