"""Jobs and pipelines as the API sees them on any replica: the leader's own, or the store's and a hand-over.

On the leader (its :class:`~.leadership.Tenure` is up) reads come from its orchestrator's and
engine's memory and changes are made in-process, as before replicas. On a follower reads come from
the shared Redis state (:class:`~.state.JobStore`, :class:`~.pipelines.store.RunStore`: what the
leader saved before it answered) and changes go to the leader through :class:`~.forwarding.Forwarder`;
:meth:`LeaderRequests.handle` carries them out there, with the caller's name as the submitter or
principal. Either way a change is answered once Redis holds it.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable
from typing import Any

from opml.jobs.v1 import jobs_pb2
from opml.jobs.v1 import pipelines_pb2 as ppb

from opml_common.errors import AlreadyExists, NotFound, Unavailable
from opml_job_orchestrator.convert import saved_job_from_proto
from opml_job_orchestrator.forwarding import Forwarder
from opml_job_orchestrator.leadership import Leadership, Tenure
from opml_job_orchestrator.orchestrator import SavedJob
from opml_job_orchestrator.pipelines.store import RunStore
from opml_job_orchestrator.spec import definition_from_proto
from opml_job_orchestrator.state import JobStore


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode())


class JobAccess:
    """``durable`` returns once every change so far is saved (``JobStore.flushed``); a change awaits
    it, up to ``durable_timeout_s``, before it answers."""

    def __init__(self, *, leadership: Leadership, store: JobStore, forwarder: Forwarder,
                 durable: Callable[[], Awaitable[None]], durable_timeout_s: float = 10.0) -> None:
        self._leadership, self._store, self._forwarder = leadership, store, forwarder
        self._durable, self._durable_timeout_s = durable, durable_timeout_s

    def _tenure(self) -> Tenure | None:
        return self._leadership.tenure

    async def get(self, job_id: str) -> SavedJob:
        """Raises: NotFound."""
        if (tenure := self._tenure()) is not None:
            return SavedJob(tenure.orchestrator.definition(job_id), tenure.orchestrator.get(job_id))
        job, submitter = await self._store.job(job_id)
        return saved_job_from_proto(job, submitter=submitter)

    async def list(self) -> list[SavedJob]:
        """Every job, in submission order."""
        if (tenure := self._tenure()) is not None:
            return [SavedJob(tenure.orchestrator.definition(s.job_id), s) for s in tenure.orchestrator.list()]
        jobs, submitters = await asyncio.gather(self._store.load(), self._store.load_submitters())
        return [saved_job_from_proto(job, submitter=submitters.get(job.status.job_id)) for job in jobs]

    async def submit(self, spec: jobs_pb2.JobSpec, submitter: str) -> SavedJob:
        """Raises: InvalidArgument (the spec, or bigger than the cluster), AlreadyExists, Unavailable."""
        definition = definition_from_proto(spec)  # every field's mistake here, on any replica
        if (tenure := self._tenure()) is None:
            job_id = (await self._forwarder.call("submit", {"spec": _b64(spec.SerializeToString()),
                                                            "submitter": submitter}))["job_id"]
            return await self.get(job_id)
        orchestrator = tenure.orchestrator
        job_id = orchestrator.submit(definition.spec, definition.program, max_retries=definition.max_retries,
                                     submitter=submitter, labels=definition.labels)
        saved = SavedJob(orchestrator.definition(job_id), orchestrator.get(job_id))  # the job as queued
        await self.saved(job_id, "submitted")
        return saved

    async def cancel(self, job_id: str) -> SavedJob:
        """Raises: NotFound, FailedPrecondition (ended already), Unavailable."""
        return await self._change("cancel", job_id)

    async def preempt(self, job_id: str) -> SavedJob:
        """Raises: NotFound, FailedPrecondition (not running), Unavailable."""
        return await self._change("preempt", job_id)

    async def _change(self, kind: str, job_id: str) -> SavedJob:
        if (tenure := self._tenure()) is None:
            await self._forwarder.call(kind, {"job_id": job_id})
            return await self.get(job_id)
        change = tenure.orchestrator.cancel if kind == "cancel" else tenure.orchestrator.preempt
        status = await change(job_id)
        await self.saved(job_id, f"{kind}ed" if kind == "preempt" else "cancelled")
        return SavedJob(tenure.orchestrator.definition(job_id), status)

    async def saved(self, job_id: str, done: str) -> None:
        try:
            await asyncio.wait_for(self._durable(), self._durable_timeout_s)
        except TimeoutError:
            raise Unavailable(f"job {job_id!r} was {done}, but its state could not be saved to Redis within "
                              f"{self._durable_timeout_s:g} s; it is saved once Redis answers (check with get)"
                              ) from None


class PipelineAccess:
    """The pipelines' reads and changes on any replica (see the module)."""

    def __init__(self, *, leadership: Leadership, store: RunStore, forwarder: Forwarder) -> None:
        self._leadership, self._store, self._forwarder = leadership, store, forwarder

    def _tenure(self) -> Tenure | None:
        return self._leadership.tenure

    async def pipelines(self) -> list[ppb.Pipeline]:
        if (tenure := self._tenure()) is not None:
            return tenure.engine.pipelines()
        return await self._store.pipelines()

    async def get(self, name: str) -> ppb.Pipeline:
        """Raises: NotFound."""
        if (tenure := self._tenure()) is not None:
            return tenure.engine.get(name)
        pipeline = await self._store.pipeline(name)
        if pipeline is None:
            raise NotFound(f"pipeline {name!r} does not exist; `opml pipeline ls` lists them")
        return pipeline

    async def runs(self, name: str) -> list[ppb.PipelineRun]:
        if (tenure := self._tenure()) is not None:
            return await tenure.engine.runs(name)
        await self.get(name)
        return await self._store.runs(name)

    async def run(self, name: str, number: int) -> ppb.PipelineRun:
        if (tenure := self._tenure()) is not None:
            return await tenure.engine.run(name, number)
        await self.get(name)
        found = await self._store.run(name, number)
        if found is None:
            raise NotFound(f"pipeline {name!r} has no run {number}")
        return found

    async def apply(self, spec: ppb.PipelineSpec, *, principal: str) -> ppb.Pipeline:
        if (tenure := self._tenure()) is not None:
            return await tenure.engine.apply(spec, principal=principal)
        answer = await self._forwarder.call("pipeline.apply", {"spec": _b64(spec.SerializeToString()),
                                                               "principal": principal})
        return ppb.Pipeline.FromString(_unb64(answer["pipeline"]))

    async def delete(self, name: str) -> None:
        if (tenure := self._tenure()) is not None:
            return await tenure.engine.delete(name)
        await self._forwarder.call("pipeline.delete", {"name": name})

    async def trigger(self, name: str, source: str, about: str) -> tuple[int, bool]:
        if (tenure := self._tenure()) is not None:
            return await tenure.engine.trigger(name, source, about)
        answer = await self._forwarder.call("pipeline.trigger", {"name": name, "source": source, "about": about})
        return int(answer["run"]), bool(answer["coalesced"])

    async def force_bless(self, name: str, number: int, *, principal: str, reason: str) -> ppb.PipelineRun:
        if (tenure := self._tenure()) is not None:
            return await tenure.engine.force_bless(name, number, principal=principal, reason=reason)
        answer = await self._forwarder.call("pipeline.bless", {"name": name, "number": number,
                                                               "principal": principal, "reason": reason})
        return ppb.PipelineRun.FromString(_unb64(answer["run"]))


class LeaderRequests:
    """The leader's handler of forwarded requests (:class:`~.forwarding.RequestConsumer`)."""

    def __init__(self, *, leadership: Leadership, jobs: JobAccess) -> None:
        self._leadership, self._jobs = leadership, jobs

    async def handle(self, kind: str, args: dict[str, Any], retaken: bool) -> dict[str, Any]:
        tenure = self._leadership.tenure
        if tenure is None:
            raise Unavailable("the replica that took this request no longer leads; try again")
        if kind == "submit":
            spec = jobs_pb2.JobSpec.FromString(_unb64(args["spec"]))
            try:
                saved = await self._jobs.submit(spec, str(args["submitter"]))
            except AlreadyExists:
                if not retaken:
                    raise
                return {"job_id": definition_from_proto(spec).spec.job_id}  # its previous leader submitted it
            return {"job_id": saved.status.job_id}
        if kind in ("cancel", "preempt"):
            await (self._jobs.cancel if kind == "cancel" else self._jobs.preempt)(str(args["job_id"]))
            return {}
        engine = tenure.engine
        if kind == "pipeline.apply":
            pipeline = await engine.apply(ppb.PipelineSpec.FromString(_unb64(args["spec"])),
                                          principal=str(args["principal"]))
            return {"pipeline": _b64(pipeline.SerializeToString())}
        if kind == "pipeline.delete":
            await engine.delete(str(args["name"]))
            return {}
        if kind == "pipeline.trigger":
            run, coalesced = await engine.trigger(str(args["name"]), str(args["source"]), str(args["about"]))
            return {"run": run, "coalesced": coalesced}
        if kind == "pipeline.bless":
            run = await engine.force_bless(str(args["name"]), int(args["number"]), principal=str(args["principal"]),
                                           reason=str(args["reason"]))
            return {"run": _b64(run.SerializeToString())}
        raise Unavailable(f"unknown request kind {kind!r} (a replica of another version?)")
