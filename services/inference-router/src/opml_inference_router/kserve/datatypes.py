"""One table for tensor element types: ModelConfig names, KServe v2 names, numpy and ONNX types.

The model config speaks Triton's ``DataType`` names in lower case (``fp32``), the wire speaks the
Open Inference Protocol's (``FP32``), numpy and ONNX Runtime have their own; every conversion in the
router goes through :data:`DATATYPES` so the four never drift apart. The table lives with the shared
KServe v2 codec (``opml_common.kserve_codec``), which the monitoring-scorer decodes the prediction log with.
"""

from opml_common.kserve_codec import BY_KSERVE, BY_NUMPY, BY_ONNX, DATATYPES, Datatype, kserve_name, of_array

__all__ = ["BY_KSERVE", "BY_NUMPY", "BY_ONNX", "DATATYPES", "Datatype", "kserve_name", "of_array"]
