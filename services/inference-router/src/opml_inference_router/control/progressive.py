"""Progressive rollouts: a new version whose bundle carries ``rollout.yaml``
(:mod:`opml_inference_router_contract.rollout_spec`) takes traffic step by step, and analyses of its
requests against the stable version's decide, without a person, whether it goes on.

A deploy of such a bundle beside a stable version routes it no traffic and starts its rollout here
(:meth:`ProgressiveRollouts.begin`); one task per rollout walks the steps:

* ``weight``: the new version gets that share of the traffic (TrafficChanged, cause ``rollout``);
* ``pause``: waits its duration, or until :meth:`resume` (PAUSED);
* ``analysis``: measurements, one per ``interval_s``, of both versions over the same interval
  (the router's :meth:`~opml_inference_router.routing.Router.take_measures`), judged by
  :mod:`.analysis`. More failed measurements than ``failure_limit``: ABORTED at once (all traffic back
  to the stable version, the new one retired as Rollback does, the failing checks with their values
  and bounds in RolloutAborted and in :meth:`get`). More inconclusive than ``inconclusive_limit``:
  PAUSED, saying why. Once ``count`` measurements passed, the next step.

After the last step the new version is promoted (as Promote does; RolloutPromoted). One rollout per
model at a time. A rollout's state is in Redis beside the deployments
(``<prefix>inference-router:rollouts``) and written at every change, so a restarted router resumes a
RUNNING rollout where it was (an analysis restarts the measurement it was in; a pause keeps its end).
Traffic changed by hand while a rollout runs (Promote, Rollback, another deploy) ends it: the rollout
never undoes a person's decision.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opml.inference.v1 import deployment_events_pb2 as events
from opml.inference.v1 import deployments_pb2 as pb

from opml_common.errors import FailedPrecondition, NotFound, OpmlError
from opml_common.events import EventEmitter
from opml_common.lifecycle import Component, cancel_and_wait
from opml_inference_router.control.analysis import FAILED, INCONCLUSIVE, CheckResult, measure
from opml_inference_router.control.state import SERVING
from opml_inference_router.routing.window import Measures
from opml_inference_router_contract.rollout_spec import ROLLOUT_FILE, Analysis, RolloutSpec, Step, load_rollout_spec

if TYPE_CHECKING:
    from opml_inference_router.control.deployments import DeploymentManager

log = logging.getLogger(__name__)

RUNNING, PAUSED, ABORTED, PROMOTED = "RUNNING", "PAUSED", "ABORTED", "PROMOTED"
ACTIVE = (RUNNING, PAUSED)
_NOTHING = Measures(0, 0, None)


def read_rollout_spec(directory: Path) -> RolloutSpec | None:
    """The bundle's ``rollout.yaml``, or None when it has none. Raises: InvalidArgument (every bad field)."""
    path = Path(directory) / ROLLOUT_FILE
    return load_rollout_spec(path) if path.is_file() else None


@dataclass
class RolloutState:
    """Where one model's rollout is; what Redis keeps and GetRollout shows."""

    model: str
    version: int
    stable: int
    spec: RolloutSpec
    phase: str = RUNNING
    reason: str = ""
    step: int = 0
    step_started: float = 0.0         # wall-clock seconds: a pause's end survives a restart
    announced: bool = False           # RolloutStepStarted emitted for ``step``
    measurements: int = 0             # in the current analysis
    failed: int = 0
    inconclusive: int = 0
    checks: list[CheckResult] = field(default_factory=list)  # the last measurement's

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "stable": self.stable, "spec": self.spec.to_dict(),
                "phase": self.phase, "reason": self.reason, "step": self.step, "step_started": self.step_started,
                "announced": self.announced, "measurements": self.measurements, "failed": self.failed,
                "inconclusive": self.inconclusive, "checks": [c.to_dict() for c in self.checks]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutState:
        return cls(**{**data, "spec": RolloutSpec.from_dict(data["spec"]),
                      "checks": [CheckResult(**c) for c in data["checks"]]})


class RolloutStore:
    """One JSON value per model in a Redis hash."""

    def __init__(self, redis: Any, *, prefix: str) -> None:
        self._redis = redis
        self._key = f"{prefix}inference-router:rollouts"

    async def save(self, state: RolloutState) -> None:
        await self._redis.hset(self._key, state.model, json.dumps(state.to_dict()))

    async def load(self) -> list[RolloutState]:
        stored = await self._redis.hgetall(self._key)
        return [RolloutState.from_dict(json.loads(value)) for _, value in sorted(stored.items())]


class ProgressiveRollouts(Component):
    """The rollouts of the ``manager``'s models (it calls :meth:`begin` on a deploy with a spec).

    Side effects: ``start()`` resumes the RUNNING rollouts ``store`` remembers (call it after the
    manager restored its deployments); ``stop()`` ends their tasks (their state stays, to resume).
    Each decision emits one event through ``events``, keyed by the model.
    """

    def __init__(self, manager: DeploymentManager, *, store: RolloutStore | None = None,
                 events: EventEmitter | None = None, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self._manager = manager
        self._store = store
        self._events = events
        self._clock = clock
        self._states: dict[str, RolloutState] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        manager.rollouts = self

    async def on_start(self) -> None:
        if self._store is None:
            return
        for state in await self._store.load():
            self._states[state.model] = state
            if state.phase == RUNNING:
                log.info("models/%s: resuming the rollout of version %d at step %d", state.model, state.version,
                         state.step)
                self._spawn(state)

    async def on_stop(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            await cancel_and_wait(task)

    # -- the API ----------------------------------------------------------------------------------

    def get(self, model: str) -> RolloutState:
        """Raises: NotFound (the model has had no rollout)."""
        state = self._states.get(model)
        if state is None:
            raise NotFound(f"models/{model} has had no rollout")
        return state

    def check_free(self, model: str) -> None:
        """Raises: FailedPrecondition when a rollout of ``model`` runs or is paused."""
        state = self._states.get(model)
        if state is not None and state.phase in ACTIVE:
            raise FailedPrecondition(f"models/{model} has a {state.phase} rollout of version {state.version}; "
                                     f"abort it or let it finish before rolling out another version")

    async def begin(self, model: str, version: int, stable: int, spec: RolloutSpec) -> None:
        """Starts the rollout of ``version`` against ``stable`` (which takes all traffic now)."""
        state = RolloutState(model, version, stable, spec, step_started=self._clock())
        self._states[model] = state
        await self._save(state)
        self._spawn(state)

    async def abort(self, model: str) -> RolloutState:
        """Raises: NotFound, FailedPrecondition (the rollout has ended)."""
        state = self._active(model)
        await cancel_and_wait(self._tasks.pop(model, None))
        await self._abort(state, "aborted by hand", [])
        return state

    async def resume(self, model: str, *, skip_analysis: bool = False) -> RolloutState:
        """Continues a paused rollout; ``skip_analysis`` passes the analysis step it is at.
        Raises: NotFound, FailedPrecondition (not paused, or nothing to skip)."""
        state = self._active(model)
        if state.phase != PAUSED:
            raise FailedPrecondition(f"models/{model}'s rollout is {state.phase}, not PAUSED; only a paused "
                                     f"rollout resumes")
        step = state.spec.steps[state.step]
        if skip_analysis and step.analysis is None:
            raise FailedPrecondition(f"models/{model}'s rollout is at step {state.step} ({step.kind}), "
                                     f"not an analysis, so there is none to skip")
        if skip_analysis or step.pause:
            self._advance(state)
        else:
            state.measurements = state.failed = state.inconclusive = 0
        state.phase, state.reason = RUNNING, ""
        await self._save(state)
        self._spawn(state)
        return state

    def _active(self, model: str) -> RolloutState:
        state = self.get(model)
        if state.phase not in ACTIVE:
            raise FailedPrecondition(f"models/{model}'s rollout of version {state.version} has ended "
                                     f"({state.phase}{': ' + state.reason if state.reason else ''})")
        return state

    # -- the task ---------------------------------------------------------------------------------

    def _spawn(self, state: RolloutState) -> None:
        self._tasks[state.model] = asyncio.create_task(self._run(state), name=f"rollout-{state.model}")

    async def _run(self, state: RolloutState) -> None:
        try:
            await self._walk(state)
        except asyncio.CancelledError:
            raise
        except OpmlError as error:
            await self._pause(state, f"step {state.step} could not be carried out: {error.message}")
        except Exception:  # noqa: BLE001 - a bug must pause the rollout, never leave it half-done unsaid
            log.exception("models/%s: rollout failed", state.model)
            await self._pause(state, f"step {state.step} failed unexpectedly; see the router's logs")
        finally:
            if self._tasks.get(state.model) is asyncio.current_task():
                del self._tasks[state.model]

    async def _walk(self, state: RolloutState) -> None:
        while state.step < len(state.spec.steps):
            if await self._ended_outside(state):
                return
            step = state.spec.steps[state.step]
            if not state.announced:
                state.announced = True
                await self._save(state)
                self._emit(events.RolloutStepStarted(model=state.model, version=state.version, step=state.step,
                                                     spec=step_message(step)), state.model)
            if step.weight is not None:
                await self._manager.set_traffic(state.model, {str(state.stable): 100.0 - step.weight,
                                                              str(state.version): step.weight}, cause="rollout")
            elif step.pause and step.pause_s is None:
                await self._pause(state, f"step {state.step} waits until the rollout is resumed")
                return
            elif step.pause:
                await asyncio.sleep(max(0.0, state.step_started + step.pause_s - self._clock()))
            elif not await self._analyse(state, step.analysis):  # type: ignore[arg-type]
                return
            self._advance(state)
            await self._save(state)
        if await self._ended_outside(state):
            return
        await self._manager.promote(state.model, state.version)
        state.phase = PROMOTED
        await self._save(state)
        self._emit(events.RolloutPromoted(model=state.model, version=state.version), state.model)
        log.info("models/%s: rollout promoted version %d", state.model, state.version)

    async def _analyse(self, state: RolloutState, analysis: Analysis) -> bool:
        """Measures until ``count`` measurements passed (True) or the limits stop the rollout (False)."""
        router = self._manager.router
        router.take_measures(state.model)  # the first interval starts now
        while state.measurements - state.failed - state.inconclusive < analysis.count:
            await asyncio.sleep(analysis.interval_s)
            if await self._ended_outside(state):
                return False
            measures = router.take_measures(state.model)
            verdict, checks = measure(analysis, measures.get(str(state.version), _NOTHING),
                                      measures.get(str(state.stable), _NOTHING))
            state.measurements += 1
            state.failed += verdict == FAILED
            state.inconclusive += verdict == INCONCLUSIVE
            state.checks = checks
            await self._save(state)
            self._emit(events.RolloutAnalysisCompleted(
                model=state.model, version=state.version, step=state.step, measurement=state.measurements,
                verdict=verdict, checks=[check_message(c) for c in checks]), state.model)
            if state.failed > analysis.failure_limit:
                failing = [c for c in checks if c.verdict == FAILED]
                await self._abort(state, f"analysis at step {state.step} failed {state.failed} of "
                                         f"{state.measurements} measurements (failure_limit="
                                         f"{analysis.failure_limit}): " + "; ".join(c.reason for c in failing), checks)
                return False
            if state.inconclusive > analysis.inconclusive_limit:
                unsure = [c for c in checks if c.verdict == INCONCLUSIVE]
                await self._pause(state, f"analysis at step {state.step} was inconclusive {state.inconclusive} "
                                         f"times (inconclusive_limit={analysis.inconclusive_limit}): "
                                         + "; ".join(f"{c.check}: {c.reason}" for c in unsure))
                return False
        return True

    def _advance(self, state: RolloutState) -> None:
        state.step += 1
        state.step_started = self._clock()
        state.announced = False
        state.measurements = state.failed = state.inconclusive = 0

    async def _ended_outside(self, state: RolloutState) -> bool:
        """Whether traffic was changed by hand so that the rollout has nothing left to do (it then ends,
        ABORTED with that reason, touching no traffic)."""
        record = self._manager.models.get(state.model)
        versions = record.versions if record is not None else {}
        for number, role in ((state.version, "new"), (state.stable, "stable")):
            if number not in versions or versions[number].state != SERVING:
                reason = f"the {role} version {number} no longer serves (changed outside the rollout)"
                break
        else:
            if record is not None and record.stable == state.version:
                reason = f"version {state.version} was made the stable one outside the rollout"
            else:
                return False
        state.phase, state.reason = ABORTED, reason
        await self._save(state)
        self._emit(events.RolloutAborted(model=state.model, version=state.version, stable_version=state.stable,
                                         step=state.step, reason=reason), state.model)
        log.warning("models/%s: rollout of version %d ended: %s", state.model, state.version, reason)
        return True

    async def _abort(self, state: RolloutState, reason: str, checks: list[CheckResult]) -> None:
        """All traffic back to the stable version at once, the new one retired; then the record."""
        try:
            await self._manager.rollback(state.model)
        except OpmlError as error:  # the versions changed meanwhile: say so beside the reason
            reason += f" (rolling back: {error.message})"
        state.phase, state.reason = ABORTED, reason
        await self._save(state)
        self._emit(events.RolloutAborted(model=state.model, version=state.version, stable_version=state.stable,
                                         step=state.step, reason=reason,
                                         checks=[check_message(c) for c in checks]), state.model)
        log.warning("models/%s: rollout of version %d aborted: %s", state.model, state.version, reason)

    async def _pause(self, state: RolloutState, reason: str) -> None:
        state.phase, state.reason = PAUSED, reason
        await self._save(state)
        self._emit(events.RolloutPaused(model=state.model, version=state.version, step=state.step, reason=reason),
                   state.model)
        log.info("models/%s: rollout of version %d paused: %s", state.model, state.version, reason)

    async def _save(self, state: RolloutState) -> None:
        if self._store is not None:
            await self._store.save(state)

    def _emit(self, message: Any, subject: str) -> None:
        if self._events is not None:
            self._events.emit(message, subject=subject)


# -- messages -------------------------------------------------------------------------------------


def step_message(step: Step) -> pb.RolloutStep:
    message = pb.RolloutStep(kind=step.kind)
    if step.weight is not None:
        message.weight_percent = step.weight
    elif step.pause:
        message.pause_s = step.pause_s or 0.0
    elif step.analysis is not None:
        a = step.analysis
        message.interval_s, message.count = a.interval_s, a.count
        message.failure_limit, message.inconclusive_limit = a.failure_limit, a.inconclusive_limit
        message.checks.extend(check.name for check in a.checks)
    return message


def check_message(result: CheckResult) -> pb.RolloutCheckResult:
    return pb.RolloutCheckResult(**result.to_dict())


def rollout_message(state: RolloutState) -> pb.Rollout:
    return pb.Rollout(model=state.model, version=state.version, stable_version=state.stable, phase=state.phase,
                      reason=state.reason, step=state.step, steps=[step_message(s) for s in state.spec.steps],
                      measurements=state.measurements, failed=state.failed, inconclusive=state.inconclusive,
                      checks=[check_message(c) for c in state.checks])
