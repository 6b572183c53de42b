"""Unit tests of the tracer's pure parts: launcher environment, control requests, the recorder's
nesting rules, post-import hooks and sitecustomize chaining, and the XSpace -> Chrome conversion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opml_trace_collector.inject import hooks
from opml_trace_collector.inject.control import parse_capture
from opml_trace_collector.inject.launcher import BOOT_DIR, build_env, default_worker
from opml_trace_collector.inject.recorder import EVALUATE, TRAIN, Recorder
from opml_trace_collector.inject.settings import TracerSettings
from opml_trace_collector.inject.xspace import StepSpan, to_chrome


def test_worker_name_comes_from_tf_config() -> None:
    assert default_worker({"TF_CONFIG": json.dumps({"cluster": {}, "task": {"type": "worker", "index": 1}})}) \
        == "worker-1"
    assert default_worker({"TF_CONFIG": json.dumps({"task": {"type": "chief", "index": 0}})}) == "chief-0"
    assert default_worker({"TF_CONFIG": "not json"}) == "local"
    assert default_worker({}) == "local"


def test_build_env_prepends_boot_dir_and_names_the_worker() -> None:
    env = build_env("j", None, {"PYTHONPATH": "/a:/b", "TF_CONFIG": json.dumps({"task": {"type": "worker", "index": 2}}),
                                "OPML_TRACE_NESTED": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(BOOT_DIR), "/a", "/b"]
    assert (env["OPML_TRACE_JOB"], env["OPML_TRACE_WORKER"]) == ("j", "worker-2")
    assert "OPML_TRACE_NESTED" not in env
    assert build_env("j", "w", {})["OPML_TRACE_WORKER"] == "w"
    assert build_env("j", "w", build_env("j", "w", {}))["PYTHONPATH"] == str(BOOT_DIR), "idempotent"
    with pytest.raises(ValueError, match="job"):
        build_env("", None, {})


def test_settings_reject_a_bad_op_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPML_TRACE_OP_FILTER", "Conv(")
    with pytest.raises(ValueError, match="op_filter"):
        TracerSettings()


# values tried for each kind of field: valid ones, bounds, and wrong types
_TRIALS = {str: ["", "a", "ab", "abc", "job-1", " x "], float: ["0", "-1", "0.5", "2", " 3 ", "1e3", "1_0", "inf",
                                                             "nan", "abc", ""],
           int: ["99", "100", "250000", "1000.0", "1.5", "1e3", "abc", ""], Path: ["", "rel/dir", "~/x", "/abs"]}


def test_the_jobs_settings_reader_agrees_with_the_pydantic_class_on_every_field() -> None:
    """``config.read`` (the job's, standard library) and ``TracerSettings`` (pydantic: the shipper, the
    docs) accept and refuse the same values, with the same result; both come from ``config.FIELDS``."""
    from pydantic import ValidationError

    from opml_trace_collector.inject import config

    assert set(TracerSettings.model_fields) == set(config.FIELDS)
    defaults = _pydantic({})
    read = config.read({})
    for name in config.FIELDS:
        assert getattr(read, name) == getattr(defaults, name), name
        assert TracerSettings.model_fields[name].description == config.FIELDS[name].description
    checked = 0
    for name, spec in config.FIELDS.items():
        trials = _TRIALS[spec.kind] + (["Conv(", "Conv2D|MatMul"] if spec.regex else [])
        for raw in trials:
            env = {f"OPML_TRACE_{name.upper()}": raw}
            try:
                theirs = getattr(_pydantic(env), name)
            except ValidationError:
                theirs = "refused"
            try:
                mine = getattr(config.read(env), name)
            except config.ConfigError as exc:
                assert f"OPML_TRACE_{name.upper()}" in str(exc)
                mine = "refused"
            assert mine == theirs, (name, raw, mine, theirs)
            checked += 1
    assert checked > 50


def _pydantic(env: dict[str, str]) -> TracerSettings:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return TracerSettings()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_the_jobs_settings_reader_checks_the_platforms_variables_and_hides_the_redis_url() -> None:
    from opml_common.config import PlatformSettings
    from opml_trace_collector.inject import config

    read = config.read({})
    platform = PlatformSettings()
    assert (read.kafka_bootstrap, read.topic_prefix, read.redis_url, read.redis_prefix) == (
        platform.kafka_bootstrap, platform.topic_prefix, platform.redis_url, platform.redis_prefix)
    with pytest.raises(config.ConfigError) as bad:
        config.read({"OPML_KAFKA_BOOTSTRAP": "nohostport", "OPML_REDIS_URL": "http://user:hunter2@h/0",
                     "OPML_TRACE_POLL_S": "0"})
    message = str(bad.value)
    assert "OPML_KAFKA_BOOTSTRAP" in message and "OPML_REDIS_URL" in message and "OPML_TRACE_POLL_S" in message
    assert "hunter2" not in message


def test_parse_capture_requests() -> None:
    raw = json.dumps({"capture_id": "c", "steps": 5, "workers": []})
    assert parse_capture(raw, "worker-0").steps == 5
    assert parse_capture(json.dumps({"capture_id": "c", "steps": 5, "workers": ["worker-1"]}), "worker-0") is None
    assert parse_capture(json.dumps({"capture_id": "c", "steps": 1, "workers": ["worker-0"]}), "worker-0").capture_id == "c"
    for bad, field in ((b"{", "JSON"), ("[]", "object"), (json.dumps({"steps": 2}), "capture_id"),
                       (json.dumps({"capture_id": "c", "steps": 0}), "steps"),
                       (json.dumps({"capture_id": "c", "steps": True}), "steps"),
                       (json.dumps({"capture_id": "c", "steps": 2, "workers": "w"}), "workers")):
        with pytest.raises(ValueError, match=field):
            parse_capture(bad, "w")


def test_recorder_counts_only_outermost_steps_and_charges_input_wait() -> None:
    recorder = Recorder()
    outer = recorder.begin()
    assert outer is not None and recorder.begin() is None, "a nested call is not a step"
    assert recorder.running
    recorder.end(outer, TRAIN, "a", 8)
    recorder.local.input_wait = 0.25
    started = recorder.begin()
    recorder.end(started, TRAIN, "a")
    failed = recorder.begin()
    recorder.abort()  # e.g. StopIteration at the end of an epoch: no step
    assert failed is not None
    recorder.end(recorder.begin(), EVALUATE, "b")
    recorder.enabled = False
    assert recorder.begin() is None
    steps = recorder.drain()
    assert [(s.step, s.kind, s.signature, s.examples) for s in steps] == [(0, TRAIN, "a", 8), (1, TRAIN, "a", 0),
                                                                          (0, EVALUATE, "b", 0)]
    assert [s.input_wait_s for s in steps] == [0.0, 0.25, 0.0]
    assert recorder.drain() == [] and recorder.total == 3


def test_recorder_keeps_each_epochs_logs_with_its_fit_and_wakes_the_observer() -> None:
    recorder = Recorder()
    woken = []
    recorder.epoch_observer = lambda: woken.append(True)
    recorder.fit_began()
    logs = {"loss": 0.5, "accuracy": 0.75}
    recorder.epoch_end(0, logs)
    logs["loss"] = 9.0  # Keras may reuse its dict: what was recorded stays
    recorder.fit_began()
    recorder.epoch_end(3, None)
    recorder.enabled = False
    recorder.epoch_end(4, {"loss": 0.1})  # off: not recorded
    epochs = recorder.drain_epochs()
    assert [(e.epoch, e.fit, e.logs) for e in epochs] == [(0, 0, {"loss": 0.5, "accuracy": 0.75}), (3, 1, {})]
    assert len(woken) == 2 and recorder.drain_epochs() == []


def test_post_import_hook_runs_after_the_module_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "opml_hooked_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hooks.when_imported("opml_hooked_mod", lambda module: seen.append(module.VALUE + 1))
    assert seen == []
    import opml_hooked_mod  # noqa: F401
    assert seen == [42]
    assert type(sys.modules["opml_hooked_mod"].__loader__).__name__ != "_HookedLoader"
    hooks.when_imported("opml_hooked_mod", lambda module: seen.append(0))  # already imported: at once
    assert seen == [42, 0]
    sys.modules.pop("opml_hooked_mod")


def test_sitecustomize_chains_to_the_one_it_shadows(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = 'yes'\n")
    env = build_env("j", "w", {**os.environ, "PYTHONPATH": str(site)})
    code = "import os, sys; print(os.environ.get('SITE_RAN'), 'tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert result.stdout.split() == ["yes", "False"], "chained, and TensorFlow is not imported eagerly"
    assert "did not import TensorFlow" in result.stderr


def test_the_tracer_imports_the_capture_code_only_when_a_capture_arrives() -> None:
    """What the tracer's thread imports to start (settings, control poll, spool, events) leaves out the
    capture's converter and upload code: a job that is never captured does not pay for importing it."""
    code = ("import sys\n"
            "from opml_trace_collector.inject import config, control, spool, tracer\n"
            "from opml_trace_collector import session\n"
            "from opml_trace_collector_contract import topics\n"
            "print(sorted(m for m in sys.modules if m.endswith(('inject.capture', 'inject.xspace'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


def _space():
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # what the tracer's converter reads
    space = xplane_pb2.XSpace()
    env = space.planes.add(name="Task Environment")
    env.stat_metadata[1].name = "profile_start_time"
    stat = env.stats.add(metadata_id=1)
    stat.uint64_value = 1_000_000_000_000
    host = space.planes.add(name="/host:CPU")
    for mid, name in ((1, "dense/MatMul:MatMul"), (2, "conv/Conv2D:_FusedConv2D"), (3, "ExecutorState::Process"),
                      (4, "EagerLocalExecute: AddV2"), (5, "EagerLocalExecute: __inference_step_7")):
        host.event_metadata[mid].name = name
    line = host.lines.add(id=7, name="tf_Compute", timestamp_ns=1000)
    for mid, offset_us in ((1, 10), (2, 20), (3, 30), (4, 40), (5, 50), (1, 60)):
        line.events.add(metadata_id=mid, offset_ps=offset_us * 1_000_000, duration_ps=2_000_000)
    return space


def test_xspace_to_chrome_trace() -> None:
    steps = [StepSpan(4, "train", "keras.fit", 1_000_000_000_000 + 5_000, 70_000)]
    trace, ops = to_chrome(_space(), metadata={"job": "j"}, steps=steps, max_events=1000)
    events = trace["traceEvents"]
    op_events = [e for e in events if e.get("cat") == "op"]
    assert ops == len(op_events) == 4
    assert [(e["name"], e["args"]["op_type"], e["ts"], e["dur"]) for e in op_events] == [
        ("dense/MatMul", "MatMul", 11.0, 2.0), ("conv/Conv2D", "_FusedConv2D", 21.0, 2.0),
        ("AddV2", "AddV2", 41.0, 2.0), ("dense/MatMul", "MatMul", 61.0, 2.0)]
    runtime = {e["name"] for e in events if e.get("cat") == "runtime"}
    assert runtime == {"ExecutorState::Process", "EagerLocalExecute: __inference_step_7"}
    [step] = [e for e in events if e.get("cat") == "step"]
    assert (step["name"], step["ts"], step["dur"], step["ph"]) == ("step 4", 5.0, 70.0, "X")
    assert {"process_name", "thread_name"} <= {e["name"] for e in events if e["ph"] == "M"}
    assert trace["displayTimeUnit"] == "ms" and trace["metadata"]["dropped_events"] == 0
    json.dumps(trace)


def test_xspace_op_filter_and_event_bound() -> None:
    trace, ops = to_chrome(_space(), metadata={}, steps=[], max_events=1000, op_filter="MatMul")
    assert ops == 2 and {e.get("cat") for e in trace["traceEvents"]} == {None, "op"}
    full, _ = to_chrome(_space(), metadata={}, steps=[], max_events=10_000)
    metadata_count = sum(1 for e in full["traceEvents"] if e["ph"] == "M")
    bounded, ops = to_chrome(_space(), metadata={}, steps=[], max_events=metadata_count + 3)
    assert ops == 3 and len(bounded["traceEvents"]) == metadata_count + 3, "ops are kept first, earliest first"
    assert bounded["metadata"]["dropped_events"] == 3


def test_control_poller_against_real_redis(settings_env: dict[str, str]) -> None:
    import redis

    from opml_trace_collector.inject.control import ControlPoller

    prefix = settings_env["OPML_REDIS_PREFIX"]
    enabled, armed, bad, warned = [], [], [], []
    poller = ControlPoller(settings_env["OPML_REDIS_URL"], prefix, "job", "worker-1",
                           set_enabled=enabled.append, arm=armed.append,
                           bad_request=lambda capture_id, reason: bad.append((capture_id, reason)),
                           warn=lambda kind, message: warned.append(kind))
    client = redis.Redis.from_url(settings_env["OPML_REDIS_URL"])
    try:
        poller.poll()
        assert enabled == [True] and armed == [] and poller.first_poll.is_set()
        client.set(f"{prefix}traces:enabled", "0")
        client.set(f"{prefix}traces:capture:job", json.dumps({"capture_id": "a", "steps": 2, "workers": []}))
        poller.poll()
        poller.poll()  # seen again: armed once
        assert enabled[-1] is False and [r.capture_id for r in armed] == ["a"]
        client.set(f"{prefix}traces:capture:job", json.dumps({"capture_id": "b", "steps": 2, "workers": ["worker-0"]}))
        poller.poll()
        client.set(f"{prefix}traces:capture:job", json.dumps({"capture_id": "c", "steps": -1}))
        poller.poll()
        poller.poll()  # seen again: still reported once
    finally:
        client.delete(f"{prefix}traces:enabled", f"{prefix}traces:capture:job")
        client.close()
        poller.close()
    assert enabled[0] is True and enabled[-1] is False
    assert [(r.capture_id, r.steps) for r in armed] == [("a", 2)], "once per capture id, only named workers"
    assert len(bad) == 1 and bad[0][0] == "c" and "steps" in bad[0][1]
    assert warned == []


def test_control_poller_without_redis_warns() -> None:
    from opml_devstack.devinfra import free_port
    from opml_trace_collector.inject.control import ControlPoller

    warned: list[str] = []
    poller = ControlPoller(f"redis://127.0.0.1:{free_port()}/0", "p:", "job", "w", set_enabled=print,
                           arm=print, bad_request=print, warn=lambda kind, message: warned.append(kind))
    for _ in range(3):
        poller.poll()  # never raises
    poller.close()
    assert poller.first_poll.is_set() and warned == ["redis"] * 3, "the tracer's warn_once dedups"
