"""What every step of the story shares: where the services are, the run's scale, its scratch folder,
and the waits that sync on a service's state or on events (never on the clock alone)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer

EVENTS_TIMEOUT_S = 60.0
"""How long in all a step waits for its events on a topic."""
Ours = Callable[[str, str, bytes], bool]
"""(ce_type, ce_subject, value) -> whether the event is this run's."""


@dataclass(frozen=True)
class Scale:
    """How big the story runs: ``full`` under `make up`, ``quick`` in the tests (the same steps, smaller)."""

    name: str
    days: int  # spans per line committed before the story trains
    span_rows: int  # rows of one line's span of one day
    trials: int  # the tuning experiment's trials in all
    parallel_trials: int
    trial_epochs: int
    pipeline_epochs: int  # the pipeline's training program's epochs
    analysis_s: float  # a rollout analysis' interval
    analysis_requests: int  # the requests each version needs in one for a verdict
    rate_rps: float  # the lines' requests a second in all (steps 4 to 6)
    request_rows: int  # patches of one line in a request
    label_share: float  # share of the requests labelled late
    label_delay_s: float  # how late
    recovered_windows: int  # windows (of each line, where split by line) of the promoted version shown (step 6)

    @property
    def rollout(self) -> dict:
        """How the pipeline's pushed models roll out (the inference-router's rollout.yaml): shadow, then
        a canary share, each judged against the serving version before going on."""
        errors = {"error_rate": {"max_increase": 0.02, "min_requests": self.analysis_requests}}
        return {"steps": [
            {"shadow": {"percent": 50}},
            {"analysis": {"interval_s": self.analysis_s, "count": 1, "inconclusive_limit": 20, "checks": errors}},
            {"weight": 30},
            {"analysis": {"interval_s": self.analysis_s, "count": 2, "inconclusive_limit": 20, "checks": errors}},
        ]}


SCALES = {
    "quick": Scale("quick", days=2, span_rows=250, trials=3, parallel_trials=2, trial_epochs=6, pipeline_epochs=15,
                   analysis_s=2.0, analysis_requests=20, rate_rps=40, request_rows=10, label_share=0.02,
                   label_delay_s=2.0, recovered_windows=1),
    "full": Scale("full", days=3, span_rows=500, trials=6, parallel_trials=2, trial_epochs=10, pipeline_epochs=25,
                  analysis_s=5.0, analysis_requests=50, rate_rps=50, request_rows=10, label_share=0.02,
                  label_delay_s=3.0, recovered_windows=2),
}


@dataclass
class Story:
    """One run of the story: the services' addresses (as `make up` exports them) and what steps hand on."""

    scale: Scale
    workdir: Path  # the run's scratch folder; jobs may pass through it (0711) to the folders made for them
    out: Path  # where the summary's plots go
    bundles_target: str = os.environ.get("OPML_BUNDLE_STORE_TARGET", "127.0.0.1:50051")
    jobs_target: str = os.environ.get("OPML_JOB_ORCHESTRATOR_TARGET", "127.0.0.1:50052")
    router_target: str = os.environ.get("OPML_INFERENCE_ROUTER_TARGET", "127.0.0.1:50053")
    # The router's inference port: its native KServe v2 front (the Python port above serves inference too)
    inference_target: str = os.environ.get("OPML_INFERENCE_ROUTER_INFERENCE_TARGET", "127.0.0.1:8001")
    traces_target: str = os.environ.get("OPML_TRACE_COLLECTOR_TARGET", "127.0.0.1:50054")
    automl_target: str = os.environ.get("OPML_AUTOML_CONTROLLER_TARGET", "127.0.0.1:50055")
    scorer_target: str = os.environ.get("OPML_MONITORING_SCORER_TARGET", "127.0.0.1:50056")
    remote: str = os.environ.get("OPML_MAIN_JOB_REMOTE", "s3://opml-bundles/vision-inspection")
    bootstrap: str = os.environ.get("OPML_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    topic_prefix: str = os.environ.get("OPML_TOPIC_PREFIX", "")
    spans_dir: Path | None = None  # the committed spans as downloaded from the bundle-store (step 1)
    live: object | None = None  # the lines' traffic and the bus watch, from step 4 to the end of step 6 (lines.Live)
    handed: dict[str, object] = field(default_factory=dict)
    """What a step leaves for later steps and the summary, by key:

    - ``trials`` (step 2): [(trial number, state name, objective or None)];  ``best``: its parameters;
    - ``line_accuracy`` (steps 3, 6): {run label: {line: the candidate's accuracy on the newest span}};
    - ``serving_version`` (steps 3, 6): the inspection model's version serving all traffic (str);
    - ``lighting`` (steps 4, 5): {line: its lamps now} as the loop's traffic sees them;
    - ``today`` (step 4): the day the loop's traffic and its new span are of (one past the newest span);
    - ``alert`` (step 5): the AlertRaised that started the loop (an ``opml.monitoring.v1`` message);
      ``runs_before``: the pipeline's newest run number before the lamps changed;
    - ``loop_run`` (step 6): the pipeline run the alert triggered (number); ``promoted``: the version
      its rollout promoted;
    - ``quality`` (steps 4-6): [(the window's last prediction's time, version, segment, window, estimate, true or None, rows)]
      of the scorer's windows; ``alert_at``: when the alert was read; ``traffic``: [(time.time(),
      {version: percent})] of the router's splits; ``shadow``: (start, end, percent) of the shadow step;
      ``answers``: [(time.time(), version, line, rows right, rows)] of every request the traffic sent;
      ``traffic_started``, ``drift_at``: when the traffic began and when line 3's lamps changed.
    """


def wait_for(what: str, check, timeout_s: float = 180.0, every_s: float = 1.0):
    """Poll ``check`` (a service's state) until it returns something truthy; fail with ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(every_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")


async def _show_events(bootstrap: str, topic: str, expect: set[str], ours: Ours, timeout_s: float) -> None:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None)
    seen: set[str] = set()
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.start()
            while not expect <= seen:
                for records in (await consumer.getmany(timeout_ms=1000)).values():
                    for record in records:
                        headers = {k: v.decode(errors="replace") for k, v in record.headers or ()}
                        kind, subject = headers.get("ce_type", ""), headers.get("ce_subject", "")
                        if kind in expect and ours(kind, subject, record.value or b""):
                            seen.add(kind)
                            print(f"   event {kind:<34} id={headers.get('ce_id', '')[:8]} subject={subject} "
                                  f"partition={record.partition} offset={record.offset}")
    except TimeoutError:
        raise SystemExit(f"this run's {', '.join(sorted(expect - seen))} did not reach {topic} within "
                         f"{timeout_s:.0f} s") from None
    finally:
        await consumer.stop()


def show_events(story: Story, topic: str, expect: set[str], ours: Ours, *,
                timeout_s: float = EVENTS_TIMEOUT_S) -> None:
    """Print this run's events on ``topic`` (a contract's topic name, prefixed here) until one of each
    type in ``expect`` came. The topic is read from its start, so it holds earlier runs' events too:
    only those ``ours`` accepts count.

    Raises: SystemExit: they did not all come within ``timeout_s`` in all (naming the missing)."""
    asyncio.run(_show_events(story.bootstrap, topic, expect, ours, timeout_s))

