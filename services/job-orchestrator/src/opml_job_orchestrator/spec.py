"""Job specs -> what the orchestrator runs (:class:`~opml_job_orchestrator.orchestrator.JobDefinition`).

Parsing a spec and the rules of a job are the contract's
(:mod:`opml_job_orchestrator_contract.jobspec`), shared with the clients that write specs; this module
turns a spec that keeps those rules into the scheduler's and the executor's view, and back.
"""

from __future__ import annotations

from opml.jobs.v1 import jobs_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_job_orchestrator.executor.base import JobProgram
from opml_job_orchestrator.orchestrator import JobDefinition
from opml_job_orchestrator.scheduler.model import JobClass, JobSpec, Resources, RoleSpec
from opml_job_orchestrator_contract.jobspec import roles_in_order, rule_violations


def definition_from_proto(spec: pb.JobSpec, *, submitter: str | None = None, check_job_env: bool = True
                          ) -> JobDefinition:
    """The orchestrator's view of a submitted spec: the scheduler's JobSpec, the JobProgram, the
    retry budget, and who submitted it (``submitter``: the caller's principal, set by the service,
    never taken from the request).

    ``check_job_env``: see :func:`~opml_job_orchestrator_contract.jobspec.rule_violations` (``False`` for a
    job saved before those rules: such a job fails at its launch, alone).

    Raises:
        InvalidArgument: a rule is broken; the field path is the message's (``roles.ps.replicas``,
            ``env.LD_PRELOAD``, ``roles.ps.command``).
    """
    violations = rule_violations(spec, check_job_env=check_job_env)
    if violations:
        raise InvalidArgument.of(violations)
    roles: dict[str, RoleSpec] = {}
    commands: dict[str, list[str]] = {}
    for role in roles_in_order(spec):
        body = spec.roles[role]
        commands[role] = list(body.command or spec.command)
        roles[role] = RoleSpec(body.replicas, Resources(cpu_millis=body.resources.cpu_millis,
                                                        memory_mib=body.resources.memory_mib, gpu=body.resources.gpu))
    interval = spec.checkpoint.interval_seconds
    job_class = JobClass.TE if spec.job_class == pb.JOB_CLASS_TE else JobClass.BE
    scheduler_spec = JobSpec(job_id=spec.name, job_class=job_class, roles=roles, priority=spec.priority,
                             checkpoint_interval_s=interval or None,
                             restart_overhead_s=spec.checkpoint.restart_overhead_seconds)
    program = JobProgram(commands=commands, env=dict(spec.env), secret_env=dict(spec.secret_env),
                         checkpoint_dir=spec.checkpoint.dir or None,
                         heartbeat_timeout_s=spec.heartbeat_timeout_seconds or None, trace=spec.trace)
    return JobDefinition(scheduler_spec, program, spec.max_retries if spec.HasField("max_retries") else None,
                         submitter, dict(spec.labels))


def definition_to_proto(definition: JobDefinition, *, secret_env: bool = False) -> pb.JobSpec:
    """The inverse of :func:`definition_from_proto`, every role with its own command; the secret env's
    values only with ``secret_env`` (the job store's copy, from which a restart runs the job again)."""
    spec, program = definition.spec, definition.program
    message = pb.JobSpec(
        name=spec.job_id, job_class=pb.JOB_CLASS_TE if spec.job_class is JobClass.TE else pb.JOB_CLASS_BE,
        priority=spec.priority, env=dict(program.env), trace=program.trace,
        heartbeat_timeout_seconds=program.heartbeat_timeout_s or 0.0,
        checkpoint=pb.Checkpoint(dir=program.checkpoint_dir or "", interval_seconds=spec.checkpoint_interval_s or 0.0,
                                 restart_overhead_seconds=spec.restart_overhead_s))
    for role, role_spec in spec.roles.items():
        resources = role_spec.resources
        message.roles[role].CopyFrom(pb.RoleSpec(
            replicas=role_spec.replicas, command=list(program.commands[role]),
            resources=pb.Resources(cpu_millis=resources.cpu_millis, memory_mib=resources.memory_mib,
                                   gpu=resources.gpu)))
    if definition.max_retries is not None:
        message.max_retries = definition.max_retries
    message.labels.update(definition.labels)
    if secret_env:
        message.secret_env.update(program.secret_env)
    return message
