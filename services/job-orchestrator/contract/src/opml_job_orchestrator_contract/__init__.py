"""The job-orchestrator's contract: what other services and users need to run jobs on it.

Its gRPC client, job resource names, the job spec (YAML -> ``JobSpec``, and the rules of a job, so a
client reports every mistake before it submits), the jobs topic and its event source.
"""

from opml_job_orchestrator_contract.client import JobClient
from opml_job_orchestrator_contract.jobspec import (
    check_env,
    load_spec,
    parse_cpu_millis,
    parse_memory_mib,
    rule_violations,
)
from opml_job_orchestrator_contract.names import EVENT_SOURCE, SERVICE, job_name
from opml_job_orchestrator_contract.topics import JOBS

__all__ = ["EVENT_SOURCE", "JOBS", "SERVICE", "JobClient", "check_env", "job_name", "load_spec", "parse_cpu_millis",
           "parse_memory_mib", "rule_violations"]
