"""The plan of a pipeline spec: its steps in an order that respects their inputs, and what each reads."""

from __future__ import annotations

from dataclasses import dataclass

from opml.jobs.v1 import pipelines_pb2 as pb

from opml_job_orchestrator_contract.pipelinespec import step_order


@dataclass(frozen=True, slots=True)
class Plan:
    """``order``: step names, every step after its inputs; ``steps``: name -> step."""

    order: tuple[str, ...]
    steps: dict[str, pb.PipelineStep]

    @classmethod
    def of(cls, spec: pb.PipelineSpec) -> Plan:
        """Raises: InvalidArgument when the steps form a cycle (a spec that passed validation never does)."""
        return cls(tuple(step_order(spec)), {step.name: step for step in spec.steps})

    def input_of(self, step: str, kind: int) -> str | None:
        """The name of the one input of ``kind`` that ``step`` reads, or None."""
        found = [name for name in self.steps[step].inputs if self.steps[name].kind == kind]
        return found[0] if found else None

    def step_of(self, kind: int) -> str | None:
        """The first step of ``kind`` in the plan's order, or None."""
        return next((name for name in self.order if self.steps[name].kind == kind), None)

    def downstream(self, step: str) -> set[str]:
        """Every step that reads ``step``, directly or not."""
        found: set[str] = set()
        for name in self.order:
            if any(i == step or i in found for i in self.steps[name].inputs):
                found.add(name)
        return found
