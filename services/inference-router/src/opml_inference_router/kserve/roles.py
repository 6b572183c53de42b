"""The role each RPC of KServe v2's GRPCInferenceService needs, on the router and on its workers.

Reads of health and metadata need reader; inference needs the ``inference`` role (reader < inference <
writer < admin), so an inference client's token cannot deploy, shift traffic or promote, which need
writer; what changes the server (loading models, shared memory, trace and log settings) needs admin.
Every RPC of the service is listed, served or not (the server checks at start-up), so one the router
does not implement still answers UNIMPLEMENTED only to a caller entitled to ask.
"""

INFERENCE_METHOD_ROLES = {
    **{method: "reader" for method in (
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
        "ModelStatistics", "RepositoryIndex", "SystemSharedMemoryStatus", "CudaSharedMemoryStatus")},
    **{method: "inference" for method in ("ModelInfer", "ModelStreamInfer")},
    **{method: "admin" for method in (
        "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
        "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings")},
}
