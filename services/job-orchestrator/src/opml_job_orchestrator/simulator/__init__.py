"""Discrete-event simulator that drives the real scheduler core over synthetic TE/BE workloads."""

from opml_job_orchestrator.simulator.events import Event, EventKind, EventQueue
from opml_job_orchestrator.simulator.report import (
    PAPER_CHANGES,
    PolicyRow,
    RunSummary,
    Spread,
    compare,
    format_table,
    percentile,
    summarize,
)
from opml_job_orchestrator.simulator.runner import JobOutcome, SimulationResult, simulate
from opml_job_orchestrator.simulator.workload import SimJob, WorkloadConfig, generate_workload

__all__ = [
    "PAPER_CHANGES",
    "Event",
    "EventKind",
    "EventQueue",
    "JobOutcome",
    "PolicyRow",
    "RunSummary",
    "SimJob",
    "SimulationResult",
    "Spread",
    "WorkloadConfig",
    "compare",
    "format_table",
    "generate_workload",
    "percentile",
    "simulate",
    "summarize",
]
