"""The job-orchestrator's contract: what other services and users need to run jobs on it.

Its gRPC clients (jobs, pipelines), resource names, the job spec and the pipeline spec (YAML -> ``JobSpec``, and the rules of a job, so a
client reports every mistake before it submits), the jobs topic and its event source.
"""

from opml_common.lazy import lazy_exports

# Imported on first use: a core or a traced job that needs only names or topics stays free of the
# client's grpc (and whatever else a submodule needs).
_EXPORTS = {
    "EVENT_SOURCE": "names",
    "JOBS": "topics",
    "PIPELINES": "topics",
    "PipelineClient": "pipelineclient",
    "load_pipeline": "pipelinespec",
    "parse_schedule": "schedule",
    "pipeline_name": "names",
    "pipeline_violations": "pipelinespec",
    "run_name": "names",
    "JobClient": "client",
    "SERVICE": "names",
    "check_env": "jobspec",
    "job_name": "names",
    "load_spec": "jobspec",
    "parse_cpu_millis": "jobspec",
    "parse_memory_mib": "jobspec",
    "rule_violations": "jobspec",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
