"""Progressive rollouts: a new version whose bundle carries ``rollout.yaml``
(:mod:`opml_inference_router_contract.rollout_spec`) takes traffic step by step, and analyses of its
requests against the stable version's decide, without a person, whether it goes on.

A deploy of such a bundle beside a stable version routes it no traffic and starts its rollout here
(:meth:`ProgressiveRollouts.begin`); one task per rollout walks the steps:

* ``weight``: the new version gets that share of the traffic (TrafficChanged, cause ``rollout``);
* ``shadow``: the router mirrors that share of the requests the stable version answers to the new
  version (:mod:`~opml_inference_router.routing.shadow`), until a weight step or the rollout's end;
* ``pause``: waits its duration, or until :meth:`resume` (PAUSED);
* ``analysis``: measurements, one per ``interval_s``, of both versions over the same interval
  (the router's :meth:`~opml_inference_router.routing.Router.take_measures` and, under a shadow step,
  its mirror's comparisons; under router replicas every replica's, pooled: :mod:`.replica_measures`)
  and of the monitoring-scorer's windows since the step began
  (:mod:`.quality`), judged by :mod:`.analysis`. More failed measurements than ``failure_limit``:
  ABORTED at once (all traffic back to the stable version, the new one retired as Rollback does, the
  failing checks with their values and bounds in RolloutAborted and in :meth:`get`). More
  inconclusive than ``inconclusive_limit``: PAUSED, saying why. Once ``count`` measurements passed,
  the next step.

After the last step the new version is promoted (as Promote does; RolloutPromoted). Each analysis's
decision (passed, failed, inconclusive) and the outcome (promoted, aborted) are written, with their
evidence, to the deployed bundle's lineage in the bundle-store (:mod:`.decisions`): saved in the
rollout's state as pending first, then written by a task of their own, so a restart writes what was
pending and the store's idempotence adds each once. One rollout per model at a time. A rollout's state is in Redis beside the deployments
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opml.inference.v1 import deployment_events_pb2 as events
from opml.inference.v1 import deployments_pb2 as pb

from opml_common.errors import FailedPrecondition, NotFound, OpmlError
from opml_common.events import EventEmitter
from opml_common.lease import Fence, NotLeader
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.metrics import ServiceMetrics
from opml_inference_router.control.analysis import (
    FAILED,
    INCONCLUSIVE,
    PASSED,
    CheckResult,
    measure,
    unconfirmed,
    verdict_of,
    waiting,
)
from opml_inference_router.control.decisions import Decision, DecisionLedger
from opml_inference_router.control.quality import Quality, QualityBook
from opml_inference_router.control.replica_measures import LocalMeasures
from opml_inference_router.control.scorer_windows import ScorerWindows
from opml_inference_router.control.state import SERVING
from opml_inference_router.routing.shadow import Comparison
from opml_inference_router.routing.window import Measures
from opml_inference_router_contract.model_config import ModelConfig
from opml_inference_router_contract.rollout_spec import (
    QUALITY_CHECKS,
    ROLLOUT_FILE,
    Analysis,
    RolloutSpec,
    Shadow,
    Step,
    comparison_of,
    load_rollout_spec,
)

if TYPE_CHECKING:
    from opml_inference_router.control.deployments import DeploymentManager

log = logging.getLogger(__name__)

RUNNING, PAUSED, ABORTED, PROMOTED = "RUNNING", "PAUSED", "ABORTED", "PROMOTED"
ACTIVE = (RUNNING, PAUSED)
_NOTHING = Measures(0, 0, None)
RECENT_INTERVALS = 4
"""The stable version's last intervals whose median p99 it is compared with too (:mod:`.analysis`)."""
_RETRY_S = (1.0, 30.0)
"""First and longest wait before writing a pending decision again (the bundle-store unavailable)."""


def read_rollout_spec(directory: Path, model: ModelConfig | None = None) -> RolloutSpec | None:
    """The bundle's ``rollout.yaml`` (checked against the bundle's ``model`` config: a shadow step's
    output must be comparable), or None when it has none. Raises: InvalidArgument (every bad field)."""
    path = Path(directory) / ROLLOUT_FILE
    return load_rollout_spec(path, model=model) if path.is_file() else None


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
    context: str = ""                 # the new version's bundle (its lineage gets the decisions)
    bundle_uuid: str = ""
    decided: int = 0                  # decisions taken so far (numbers them)
    pending: list[dict] = field(default_factory=list)  # decisions not yet in the bundle-store

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "stable": self.stable, "spec": self.spec.to_dict(),
                "phase": self.phase, "reason": self.reason, "step": self.step, "step_started": self.step_started,
                "announced": self.announced, "measurements": self.measurements, "failed": self.failed,
                "inconclusive": self.inconclusive, "checks": [c.to_dict() for c in self.checks],
                "context": self.context, "bundle_uuid": self.bundle_uuid, "decided": self.decided,
                "pending": self.pending}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutState:
        return cls(**{**data, "spec": RolloutSpec.from_dict(data["spec"]),
                      "checks": [CheckResult(**c) for c in data["checks"]]})


# KEYS: the rollouts' hash, [the fence]; ARGV: the fence's token ('' unfenced), the model, its state
_SAVE = """
if #KEYS == 2 and redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""


class RolloutStore:
    """One JSON value per model in a Redis hash. ``fence``: the lease's fence of the replica that
    writes (router replicas: only the leader drives rollouts, and a deposed leader's late write is
    refused in the same Lua script that makes it: ``NotLeader``); None: one router, the only writer."""

    def __init__(self, redis: Any, *, prefix: str, fence: Callable[[], Fence] | None = None) -> None:
        self._redis = redis
        self._key = f"{prefix}inference-router:rollouts"
        self._fence = fence
        self._save = redis.register_script(_SAVE)

    async def save(self, state: RolloutState) -> None:
        """Raises: NotLeader (the lease moved on: nothing was written)."""
        fence = self._fence() if self._fence is not None else None
        keys = [self._key] + ([fence.key] if fence is not None else [])
        token = str(fence.token) if fence is not None else ""
        if not await self._save(keys=keys, args=[token, state.model, json.dumps(state.to_dict())]):
            raise NotLeader(f"the inference-router lease moved on (this tenure's fence {token}): the rollout of "
                            f"models/{state.model} was not written")

    async def load(self) -> list[RolloutState]:
        stored = await self._redis.hgetall(self._key)
        return [RolloutState.from_dict(json.loads(value)) for _, value in sorted(stored.items())]


class RolloutMetrics:
    """``opml_inference_router_rollout_step{model,version}`` (the step a running or paused rollout of the
    new ``version`` is at; no series once it ended) and ``_rollout_decisions_total{model,kind,verdict}``
    (an analysis' measurements passed, failed or inconclusive; the rollouts promoted or aborted)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.step = metrics.gauge("rollout_step", "Index of the step a model's running or paused rollout is at, "
                                  "labelled with its new version (no series once the rollout ended).",
                                  ("model", "version"))
        self.decisions = metrics.counter("rollout_decisions_total", "Rollout decisions: kind analysis (a "
                                         "measurement's verdict: passed, failed, inconclusive), promoted, aborted.",
                                         ("model", "kind", "verdict"))

    def show(self, state: RolloutState) -> None:
        if state.phase in ACTIVE:
            self.step.labels(state.model, str(state.version)).set(state.step)
        else:
            try:
                self.step.remove(state.model, str(state.version))
            except KeyError:
                pass


class Mirrors:
    """The shadow mirrors a router runs for rollouts (model -> the new version and the shadow step)."""

    def __init__(self, manager: DeploymentManager) -> None:
        self._manager = manager
        self._running: dict[str, tuple[int, Shadow]] = {}

    async def follow(self, state: RolloutState) -> None:
        """Starts, changes or stops the router's mirror to what the current step has in force."""
        shadow = state.spec.shadow_at(state.step)
        if shadow is None:
            await self.stop(state.model)
            return
        if self._running.get(state.model) == (state.version, shadow):
            return
        record = self._manager.models.get(state.model)
        entry = record.versions.get(state.version) if record is not None else None
        config = entry.config if entry is not None else None
        output = next((o for o in config.outputs if o.name == shadow.output), config.outputs[0]) if config else None
        kind = comparison_of(output, config.max_batch_size) if config is not None and output is not None else None
        if kind is None:  # checked when deployed; a config that changed since cannot be mirrored
            raise FailedPrecondition(f"version {state.version}'s output {shadow.output or '(first)'} cannot be "
                                     f"compared, so it cannot be mirrored")
        await self._manager.router.start_shadow(state.model, str(state.version), shadow.percent,
                                                Comparison(output.name, kind, shadow.tolerance))  # type: ignore[union-attr]
        self._running[state.model] = (state.version, shadow)
        log.info("models/%s: mirroring %g%% of the stable version's requests to version %d", state.model,
                 shadow.percent, state.version)

    async def stop(self, model: str) -> None:
        if self._running.pop(model, None) is not None:
            await self._manager.router.stop_shadow(model)

    async def keep_only(self, models: set[str]) -> None:
        for model in [m for m in self._running if m not in models]:
            await self.stop(model)

    async def stop_all(self) -> None:
        await self.keep_only(set())

    def forget(self) -> None:
        """Leaves the router's mirrors to another owner (this replica now leads)."""
        self._running.clear()


class ProgressiveRollouts(Component):
    """The rollouts of the ``manager``'s models (it calls :meth:`begin` on a deploy with a spec).

    Side effects: ``start()`` resumes the RUNNING rollouts ``store`` remembers (call it after the
    manager restored its deployments) and writes their pending decisions; ``stop()`` ends their tasks
    (their state stays, to resume). Each decision emits one event through ``events``, keyed by the
    model, and is written to the bundle's lineage through ``ledger`` (None: not written). ``quality``:
    the monitoring-scorer's windows (None: the estimated_accuracy and accuracy checks stay inconclusive);
    ``scorer``: where a quality check that failed is confirmed before the rollout aborts on it (None:
    the events' numbers are acted on as they are); ``metrics``: where :class:`RolloutMetrics` go (None:
    not exported); ``measures``: where an analysis reads the versions' measures (None: this router's
    own; router replicas: :class:`~.replica_measures.ReplicaMeasures`).
    """

    def __init__(self, manager: DeploymentManager, *, store: RolloutStore | None = None,
                 events: EventEmitter | None = None, quality: QualityBook | None = None,
                 ledger: DecisionLedger | None = None, scorer: ScorerWindows | None = None,
                 metrics: ServiceMetrics | None = None, measures: LocalMeasures | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self._manager = manager
        self._store = store
        self._events = events
        self._quality = quality
        self._ledger = ledger
        self._scorer = scorer
        self._clock = clock
        self._metrics = RolloutMetrics(metrics) if metrics is not None else None
        self._states: dict[str, RolloutState] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._writers: dict[str, asyncio.Task] = {}
        self._mirrors = Mirrors(manager)
        self._measures = measures or LocalMeasures(manager.router)
        manager.rollouts = self

    async def on_start(self) -> None:
        if self._store is None:
            return
        for state in await self._store.load():
            self._states[state.model] = state
            if self._metrics is not None:
                self._metrics.show(state)
            if state.phase == RUNNING:
                log.info("models/%s: resuming the rollout of version %d at step %d", state.model, state.version,
                         state.step)
                self._spawn(state)
            if state.pending:
                self._write_pending(state)

    async def on_stop(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        writers, self._writers = list(self._writers.values()), {}
        for task in [*tasks, *writers]:
            await cancel_and_wait(task)
        if self._ledger is not None:
            await self._ledger.close()
        if self._scorer is not None:
            await self._scorer.close()

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
        record = self._manager.models.get(model)
        entry = record.versions.get(version) if record is not None else None
        state = RolloutState(model, version, stable, spec, step_started=self._clock(),
                             context=entry.source.context if entry is not None else "",
                             bundle_uuid=entry.bundle_uuid if entry is not None else "")
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

    async def written(self, model: str) -> None:
        """Returns once the model's pending decisions are in the bundle-store (or given up: logged)."""
        task = self._writers.get(model)
        if task is not None:
            await asyncio.shield(task)

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
            await self._carry(state)
        except NotLeader as deposed:  # the next leader resumes it from what this tenure last wrote
            log.warning("models/%s: the rollout stops here: %s", state.model, deposed.message)
        finally:
            if self._tasks.get(state.model) is asyncio.current_task():
                del self._tasks[state.model]

    async def _carry(self, state: RolloutState) -> None:
        try:
            await self._walk(state)
        except (asyncio.CancelledError, NotLeader):
            raise
        except OpmlError as error:
            await self._pause(state, f"step {state.step} could not be carried out: {error.message}")
        except Exception:  # noqa: BLE001 - a bug must pause the rollout, never leave it half-done unsaid
            log.exception("models/%s: rollout failed", state.model)
            await self._pause(state, f"step {state.step} failed unexpectedly; see the router's logs")

    async def _walk(self, state: RolloutState) -> None:
        while state.step < len(state.spec.steps):
            if await self._ended_outside(state):
                return
            await self._mirrors.follow(state)
            step = state.spec.steps[state.step]
            if not state.announced:
                state.announced = True
                await self._save(state)
                self._emit(events.RolloutStepStarted(model=state.model, version=state.version, step=state.step,
                                                     spec=step_message(step)), state.model)
            if step.weight is not None:
                await self._manager.set_traffic(state.model, {str(state.stable): 100.0 - step.weight,
                                                              str(state.version): step.weight}, cause="rollout")
            elif step.shadow is not None:
                pass  # the mirror was started above, and stays until a weight step or the end
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
        await self._mirrors.stop(state.model)
        await self._manager.promote(state.model, state.version)
        state.phase = PROMOTED
        self._decide(state, "promoted", PROMOTED, f"every step passed; version {state.version} takes all traffic",
                     [])
        await self._save(state)
        self._write_pending(state)
        self._emit(events.RolloutPromoted(model=state.model, version=state.version), state.model)
        log.info("models/%s: rollout promoted version %d", state.model, state.version)

    async def _analyse(self, state: RolloutState, analysis: Analysis) -> bool:
        """Measures until ``count`` measurements passed (True) or the limits stop the rollout (False)."""
        before, _ = await self._measures.begin(state.model)  # the first interval starts now
        recent: deque[float] = deque(maxlen=RECENT_INTERVALS)  # the stable version's p99 of each interval
        if before.get(str(state.stable), _NOTHING).p99_s is not None:
            recent.append(before[str(state.stable)].p99_s)  # type: ignore[arg-type]
        while state.measurements - state.failed - state.inconclusive < analysis.count:
            await asyncio.sleep(analysis.interval_s)
            if await self._ended_outside(state):
                return False
            measures, shadow = await self._measures.take(state.model)
            stable = measures.get(str(state.stable), _NOTHING)
            new_quality, stable_quality = await self._quality_of(state, analysis)
            verdict, checks = measure(analysis, measures.get(str(state.version), _NOTHING), stable, shadow=shadow,
                                      new_quality=new_quality, stable_quality=stable_quality,
                                      stable_recent=tuple(recent))
            if stable.p99_s is not None:
                recent.append(stable.p99_s)
            verdict = self._without_waiting(state, analysis, checks)
            if verdict == FAILED:
                verdict, checks = await self._confirmed(state, analysis, checks)
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
                reason = (f"analysis at step {state.step} failed {state.failed} of {state.measurements} "
                          f"measurements (failure_limit={analysis.failure_limit}): "
                          + "; ".join(f"{c.check}: {c.reason}" for c in failing))
                self._decide(state, "analysis", FAILED, reason, checks)
                await self._abort(state, reason, checks)
                return False
            if state.inconclusive > analysis.inconclusive_limit:
                unsure = [c for c in checks if c.verdict == INCONCLUSIVE]
                reason = (f"analysis at step {state.step} was inconclusive {state.inconclusive} times "
                          f"(inconclusive_limit={analysis.inconclusive_limit}): "
                          + "; ".join(f"{c.check}: {c.reason}" for c in unsure))
                self._decide(state, "analysis", INCONCLUSIVE, reason, checks)
                await self._pause(state, reason)
                return False
        self._decide(state, "analysis", PASSED, f"analysis at step {state.step}: {analysis.count} measurements "
                                                f"passed of {state.measurements}", state.checks)
        await self._save(state)
        self._write_pending(state)
        return True

    @staticmethod
    def _without_waiting(state: RolloutState, analysis: Analysis, checks: list[CheckResult]) -> str:
        """A measurement's verdict with the scorer's checks that wait for evidence left out: their
        windows since the step began come as the scorer closes and labels them (a window of 1000
        predictions takes 13 s at 75 requests/s, its labels what they take), so until then each
        measurement is judged on the other checks, and counting them inconclusive paused a rollout
        before the scorer had said anything. The analysis still passes only on them: the measurement
        that would complete ``count`` while one still waits is inconclusive."""
        judged = [c for c in checks if not waiting(c, analysis)]
        if len(judged) == len(checks):
            return verdict_of(checks)
        verdict = verdict_of(judged) if judged else INCONCLUSIVE
        passed = state.measurements - state.failed - state.inconclusive
        return INCONCLUSIVE if verdict == PASSED and passed + 1 >= analysis.count else verdict

    async def _confirmed(self, state: RolloutState, analysis: Analysis,
                         checks: list[CheckResult]) -> tuple[str, list[CheckResult]]:
        """Events are hints: a quality check that failed on the scorer's events is judged again on the
        windows read from the scorer itself before the rollout acts on it; when they cannot be read, it
        is inconclusive (a rollout is never aborted on numbers its source did not confirm)."""
        if self._scorer is None or not any(c.verdict == FAILED and c.check in QUALITY_CHECKS for c in checks):
            return verdict_of(checks), checks
        try:
            new = await self._scorer.since(state.model, state.version, state.step_started)
            stable = await self._scorer.since(state.model, state.stable, state.step_started)
        except OpmlError as error:
            log.warning("models/%s: the monitoring-scorer's numbers could not be confirmed: %s", state.model,
                        error.message)
            checks = [unconfirmed(c, f"the monitoring-scorer could not be read ({error.message})")
                      if c.check in QUALITY_CHECKS else c for c in checks]
            return verdict_of(checks), checks
        quality_checks = Analysis(analysis.interval_s, checks=tuple(c for c in analysis.checks
                                                                    if c.name in QUALITY_CHECKS))
        _, confirmed = measure(quality_checks, _NOTHING, _NOTHING, new_quality=new, stable_quality=stable)
        by_name = {c.check: c for c in confirmed}
        checks = [by_name.get(c.check, c) for c in checks]
        return verdict_of(checks), checks

    async def _quality_of(self, state: RolloutState, analysis: Analysis) -> tuple[Quality, Quality]:
        """The scorer's windows of each version since the analysis step began (when a check reads them):
        the events consumed, or the scorer's own windows when they hold more: the events came to the
        router up to 15 s after the scorer published them in the bench, and no event carries the labels
        of a window still open (its 1,000 predictions take 13 s at 75 requests/s), which the scorer's
        windows read back do; judged on the events once they had a closed window, a worse version was
        rolled back 7 intervals after the labels read back showed it."""
        if self._quality is None or not any(c.name in QUALITY_CHECKS for c in analysis.checks):
            return Quality(), Quality()
        new = await self._quality.since(state.model, state.version, state.step_started)
        stable = await self._quality.since(state.model, state.stable, state.step_started)
        if self._scorer is None:
            return new, stable
        try:
            read = (await self._scorer.since(state.model, state.version, state.step_started),
                    await self._scorer.since(state.model, state.stable, state.step_started))
        except OpmlError as error:
            log.debug("models/%s: the monitoring-scorer's windows could not be read: %s", state.model, error.message)
            return new, stable
        return tuple(r if (r.labels, r.predictions) >= (q.labels, q.predictions) else q  # type: ignore[return-value]
                     for r, q in zip(read, (new, stable), strict=True))

    # -- decisions in the lineage ----------------------------------------------------------------

    def _decide(self, state: RolloutState, kind: str, verdict: str, reason: str, checks: list[CheckResult]) -> None:
        """Adds a decision to the state's pending ones (the caller saves the state, then writes them)."""
        state.decided += 1
        if self._metrics is not None:
            self._metrics.decisions.labels(state.model, kind, verdict.lower()).inc()
        if self._ledger is None or not state.bundle_uuid:
            return
        decision = Decision(model=state.model, version=state.version, stable=state.stable, context=state.context,
                            bundle_uuid=state.bundle_uuid, kind=kind, verdict=verdict, step=state.step,
                            sequence=state.decided, measurement=state.measurements, reason=reason,
                            checks=[c.to_dict() for c in checks], time=self._clock())
        state.pending.append(decision.to_dict())

    def _write_pending(self, state: RolloutState) -> None:
        """Writes the state's pending decisions in a task of its own (the rollout never waits for the
        bundle-store), in order, retrying while the store is unavailable."""
        if self._ledger is None or not state.pending:
            return
        running = self._writers.get(state.model)
        if running is not None and not running.done():
            return  # its loop writes what was added, in order (it ends only once none is left)
        self._writers[state.model] = asyncio.create_task(self._write(state), name=f"decisions-{state.model}")

    async def _write(self, state: RolloutState) -> None:
        wait = _RETRY_S[0]
        while state.pending:
            decision = Decision(**state.pending[0])
            try:
                await self._ledger.write(decision)  # type: ignore[union-attr]
            except OpmlError as error:
                if error.retriable:
                    log.warning("models/%s: writing rollout decision %s to the bundle-store failed, retrying in "
                                "%.0f s: %s", state.model, decision.bundle_name, wait, error.message)
                    await asyncio.sleep(wait)
                    wait = min(wait * 2, _RETRY_S[1])
                    continue
                log.error("models/%s: rollout decision %s cannot be written to the lineage of bundle %s: %s",
                          state.model, decision.bundle_name, decision.bundle_uuid, error.message)
            except Exception:  # noqa: BLE001 - a bug must not end the writer with the rest unwritten
                log.exception("models/%s: rollout decision %s was not written", state.model, decision.bundle_name)
            state.pending.pop(0)
            try:
                await self._save(state)
            except NotLeader as deposed:  # the next leader writes what is pending (idempotent)
                log.warning("models/%s: the rollout's decisions stop here: %s", state.model, deposed.message)
                return

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
        await self._mirrors.stop(state.model)
        state.phase, state.reason = ABORTED, reason
        self._decide(state, "aborted", ABORTED, reason, [])
        await self._save(state)
        self._write_pending(state)
        self._emit(events.RolloutAborted(model=state.model, version=state.version, stable_version=state.stable,
                                         step=state.step, reason=reason), state.model)
        log.warning("models/%s: rollout of version %d ended: %s", state.model, state.version, reason)
        return True

    async def _abort(self, state: RolloutState, reason: str, checks: list[CheckResult]) -> None:
        """All traffic back to the stable version at once, the new one retired; then the record."""
        await self._mirrors.stop(state.model)
        try:
            await self._manager.rollback(state.model)
        except OpmlError as error:  # the versions changed meanwhile: say so beside the reason
            reason += f" (rolling back: {error.message})"
        state.phase, state.reason = ABORTED, reason
        self._decide(state, "aborted", ABORTED, reason, checks)
        await self._save(state)
        self._write_pending(state)
        self._emit(events.RolloutAborted(model=state.model, version=state.version, stable_version=state.stable,
                                         step=state.step, reason=reason,
                                         checks=[check_message(c) for c in checks]), state.model)
        log.warning("models/%s: rollout of version %d aborted: %s", state.model, state.version, reason)

    async def _pause(self, state: RolloutState, reason: str) -> None:
        state.phase, state.reason = PAUSED, reason
        await self._save(state)
        self._write_pending(state)
        self._emit(events.RolloutPaused(model=state.model, version=state.version, step=state.step, reason=reason),
                   state.model)
        log.info("models/%s: rollout of version %d paused: %s", state.model, state.version, reason)

    async def _save(self, state: RolloutState) -> None:
        if self._metrics is not None:
            self._metrics.show(state)
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
    elif step.shadow is not None:
        message.shadow_percent, message.shadow_output = step.shadow.percent, step.shadow.output
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
