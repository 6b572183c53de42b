"""MLServer 1.7 custom runtime serving an ONNX file with onnxruntime: the MLServer peer of
bench/inference_router_peers.py (run in .venv-peers-mlserver, never by the project's Python).

MLServer imports it by its ``implementation`` path; its adaptive batcher merges requests along the
first dimension before ``predict`` and splits the response back. ``parameters.uri`` is the ONNX
file, ``parameters.extra.intra_op_threads`` the replica's thread count (the same as the router's
workers get, so the comparison is per core).
"""

from __future__ import annotations

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxRuntime(MLModel):
    async def load(self) -> bool:
        parameters = self.settings.parameters
        options = ort.SessionOptions()
        options.intra_op_num_threads = int((parameters.extra or {}).get("intra_op_threads", 1))
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(parameters.uri, options, providers=["CPUExecutionProvider"])
        self._outputs = [output.name for output in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {request_input.name: NumpyCodec.decode_input(request_input) for request_input in payload.inputs}
        results = self._session.run(self._outputs, feeds)
        return InferenceResponse(model_name=self.name, id=payload.id,
                                 outputs=[NumpyCodec.encode_output(name, value)
                                          for name, value in zip(self._outputs, results)])
