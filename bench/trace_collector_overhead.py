"""Cost of the trace-collector's injected tracer on a real Keras training loop.

1. Always-on overhead: the same Keras CNN training run untraced and traced (``python -m
   opml_trace_collector.inject.run``, events published to a real broker), runs interleaved in
   alternating order (ABBA...) so machine drift hits both arms; per-step time = median epoch time
   / steps; overhead per pair = traced / untraced - 1, reported with its spread.
   On a shared, loaded machine process-to-process noise swamps a 1% effect, so the same comparison
   is also made inside one traced process: epochs alternate (ABBA) between the tracer's patches in
   place and the original functions put back; overhead per adjacent epoch pair, with its spread
   (the tracer's background thread runs in both arms there, so process A/B is the complete cost).
2. The hot path alone: Recorder.begin/end per step in nanoseconds, as a share of the step time
   (a noise-free lower bound of (1)).
3. On-demand capture: a traced run where a capture of N steps is armed through Redis; the median
   time of a captured step against the run's other steps (the tracer's own StepRecords), the extra
   time of the epoch holding the capture (profiler start/stop included), the trace size, and the
   time from the last captured step to the CaptureCompleted announcement (conversion + gzip + S3
   upload, off the job's thread).

4. Whole-process CPU (``--whole``): the same job untraced and traced (the tracer's environment, as
   the job-orchestrator's executor sets it), a short (~10 s) and a long (~60 s) one, pairs
   interleaved (ABBA); CPU = user + sys of the process and its children (getrusage
   RUSAGE_CHILDREN around each run), wall time too. Per pair traced - untraced, reported as the
   mean with its 95% confidence interval, in seconds and as % of the untraced median. This is the
   figure that includes what (1)'s in-process comparison leaves out: the tracer's imports and
   set-up (on its own thread), its batches, and its exit. ``--concurrent`` runs each pair's two
   processes at the same time, pinned to one CPU (``--cpu``), so that the host's changing speed (this
   is a VM: steal time and neighbours' cache use move a 13 s job's CPU by +-15% from run to run) hits
   both arms alike; the pair's difference then has ~1/10 of the sequential pairs' spread. The
   percentages are of the untraced job run alone (``--solo-runs``), not of its CPU in a pair, which
   sharing the core's caches inflates. ``--tf-threads N`` runs both arms with N
   intra-op and N inter-op TensorFlow threads (and N OpenMP threads): TensorFlow's default pools
   spin and steal differently from run to run (up to 2.6 s of CPU between two identical 13 s runs),
   which hides a 1% difference in any affordable number of pairs; the tracer's own work does not
   depend on the pools, so fixing them shows its cost with a usable interval.
   ``--stack-strata N`` runs pair p's job (both arms) beneath a padding frame of
   (p mod N) x 16 KiB / N bytes. CPython 3.11 frees a thread's frame-stack chunk (16 KiB, mmap'd) as soon
   as its first frame returns, so a loop calling across a chunk boundary maps, faults in and unmaps a
   chunk on every call (python/cpython#142183, fixed in 3.13 and 3.14 by caching one chunk). Where the
   boundaries fall depends on every frame below: the same untraced job makes 112k to 232k minor faults
   by the depth it runs at (docs/benchmarks.md), and the tracer's few frames move the boundaries like
   any other change of depth would. The strata spread the job over one chunk's worth of positions, so the difference is
   the tracer's cost averaged over where a program's frames happen to fall, not one draw of it; each
   stratum's difference is reported too, with the minor faults of each arm (``getrusage``).
   A traced process keeps freed chunks (the tracer's ``sitecustomize``: inject/spare_chunks.py), so the
   traced arm no longer churns at any position; each arm's chunk reuses are reported, and
   ``--untraced-keeps-chunks`` gives the untraced arm the same kept chunks: the difference is then the
   tracer's own cost, apart from the churn it saves the job.

5. The tracer's fixed cost (``--fixed``): a trivial TensorFlow program (import, 20 steps of a small
   tf.function, then ``--hold`` seconds idle so the tracer's batches and control polls run) untraced
   and traced, many interleaved pairs: process CPU (getrusage), and in the traced runs the CPU
   clocks of the tracer's own threads read at exit (its thread, and asyncio's resolver threads of
   trees before the shipper) and how long the job's thread waited in the tracer's exit. A shipper
   (``inject.ship``) runs for the whole bench, as on a host; its CPU from each traced job's start
   to that job's events delivered is reported apart (per job and per event), never in the job's. TensorFlow's import dominates the
   process CPU, so the thread clocks are the precise figure; the process difference checks them.

Starts its own broker/S3/Redis (opml_devstack.devinfra). Usage:
    .venv/bin/python bench/trace_collector_overhead.py [--pairs 3] [--steps 20] [--epochs 3]
        [--interleave 60] [--interleave-steps 5] [--capture-steps 10] [--out results.json]
    .venv/bin/python bench/trace_collector_overhead.py --whole [--short-pairs 8] [--long-pairs 4] [--tf-threads 1]
        [--concurrent --cpu 0 | --split-cpus 0,1] [--stack-strata 8] [--untraced-keeps-chunks]
    .venv/bin/python bench/trace_collector_overhead.py --fixed [--fixed-pairs 10] [--hold 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opml_common.config import PlatformSettings

HERE = Path(__file__).resolve()
_FRAME_CHUNK_BYTES = 16 * 1024  # CPython 3.11's frame-stack chunk (DATA_STACK_CHUNK_SIZE), see --stack-strata
# The workloads run this file too: the platform's libraries (the bus, pydantic, redis, aiokafka) are
# imported inside the functions that drive the runs, never at the top, or the untraced arm would pay
# the tracer's imports as well and every whole-process difference would miss them.


@contextlib.contextmanager
def _infra(tmp: str) -> Iterator[tuple[dict[str, str], PlatformSettings]]:
    """The bench's own broker/S3/Redis: the runs' environment and settings, the traces topic created."""
    from _stack import deleting_redis_keys

    from opml_common.bus import ensure_topics
    from opml_common.config import PlatformSettings
    from opml_devstack.devinfra import DevInfra
    from opml_trace_collector_contract.topics import TRACES

    prefix = f"bench{os.getpid()}-"
    with DevInfra(Path(tmp) / "infra") as infra, \
            deleting_redis_keys(infra.redis_url, f"opml-bench:{prefix}") as redis_prefix:
        env = {**os.environ, **infra.env(), "OPML_TOPIC_PREFIX": prefix, "OPML_REDIS_PREFIX": redis_prefix,
               "OPML_TRACE_SPOOL_DIR": f"{tmp}/spool", "OPML_TRACE_SESSION_DIR": f"{tmp}/sessions",
               "TF_CPP_MIN_LOG_LEVEL": "2"}
        platform = PlatformSettings(**{k[5:].lower(): v for k, v in env.items()
                                       if k in ("OPML_KAFKA_BOOTSTRAP", "OPML_TOPIC_PREFIX")})
        asyncio.run(ensure_topics(platform, [TRACES]))
        yield env, platform


def _report_threads_at_exit(out: Path) -> None:
    """(4)'s workload, before TensorFlow is imported: at exit, after the tracer's own exit hook (atexit
    runs the last registered first), append the CPU of each of the process's threads to ``out``: the
    job's thread, TensorFlow's pools by name, and threads that ended (the tracer's), as the rest of
    the process's getrusage. Tells where a whole-process difference lands."""
    import atexit

    def report() -> None:
        import resource
        tick = os.sysconf("SC_CLK_TCK")
        threads: dict[str, float] = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            except OSError:  # ended meanwhile
                continue
            fields = stat.rsplit(")", 1)[1].split()
            name = "job thread" if int(tid) == os.getpid() else stat[stat.index("(") + 1:stat.rindex(")")]
            threads[name] = threads.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        usage = resource.getrusage(resource.RUSAGE_SELF)
        threads["ended threads"] = usage.ru_utime + usage.ru_stime - sum(threads.values())
        tracer = sys.modules.get("opml_trace_collector.inject.tracer")
        found = tracer._tracer if tracer else None
        if found is not None:
            threads["ended threads: the tracer's (its clock)"] = found.thread_cpu_s
        faults = {"process": usage.ru_minflt, "job thread": resource.getrusage(resource.RUSAGE_THREAD).ru_minflt}
        spare = sys.modules.get("opml_trace_collector.inject.spare_chunks")  # no import in the untraced arm
        with out.open("a") as file:
            file.write(json.dumps({"cpu_s": threads, "minor_faults": faults,
                                   "chunk_reuses": spare.chunk_reuses() if spare else 0}) + "\n")

    atexit.register(report)


def workload(steps: int, epochs: int, batch_size: int, pause_s: float, interleave: int = 0,
             interleave_steps: int = 5) -> None:
    """The measured job: a small CNN on synthetic 28x28 images; prints one JSON line of epoch times."""
    import numpy as np
    import tensorflow as tf

    class EpochTimer(tf.keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):  # noqa: ANN001
            self._t = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):  # noqa: ANN001
            self.times.append(time.perf_counter() - self._t)

    rng = np.random.default_rng(0)
    x = rng.random((steps * batch_size, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, size=(steps * batch_size,))
    model = tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)  # warm-up: tracing, allocation
    print("warm", flush=True)
    if interleave:
        n = interleave_steps * batch_size
        print(json.dumps(interleaved_epochs(model, x[:n], y[:n], batch_size, interleave, EpochTimer)), flush=True)
        return
    time.sleep(pause_s)
    timer = EpochTimer()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[timer])
    print(json.dumps({"epoch_s": timer.times}), flush=True)


def beneath_padding(pad_bytes: int, run: Callable[[], None]) -> None:
    """Call ``run`` beneath one frame of ``pad_bytes`` bytes of local slots: every frame of the job
    sits that much further along its thread's frame stack (see ``--stack-strata``)."""
    slots = pad_bytes // 8
    body = f"    {' = '.join(f'_{i}' for i in range(slots))} = None\n" if slots else ""
    namespace: dict = {}
    exec(compile(f"def padded(run):\n{body}    return run()\n", "<stack padding>", "exec"), namespace)  # noqa: S102
    namespace["padded"](run)


def minor_fault_cost_us(pages: int = 20_000) -> float:
    """CPU (mostly the kernel's) of one minor page fault here: fresh anonymous pages touched one by one."""
    import mmap
    import resource
    area = mmap.mmap(-1, pages * mmap.PAGESIZE)
    before = resource.getrusage(resource.RUSAGE_THREAD)
    for offset in range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE):
        area[offset] = 1
    after = resource.getrusage(resource.RUSAGE_THREAD)
    area.close()
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return 1e6 * cpu / max(1, after.ru_minflt - before.ru_minflt)


def interleaved_epochs(model, x, y, batch_size: int, pairs: int, timer_class) -> dict:  # noqa: ANN001
    """In a traced process: epochs alternately with the tracer's patches in place and with the original
    functions put back (ABBA order), so both arms see the same process and the same machine load."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from tensorflow.python.eager.polymorphic_function.polymorphic_function import Function

    from opml_trace_collector.inject import tracer
    assert tracer._tracer is not None, "run the interleaved workload under the tracer"
    swaps = [(Function, "__call__"), (TensorFlowTrainer, "fit"), (TensorFlowTrainer, "make_train_function")]
    patched = {key: key[0].__dict__[key[1]] for key in swaps}
    traced_fn = model.train_function
    times: dict[str, list[float]] = {"traced": [], "untraced": []}
    for index in range(2 * pairs):
        on = index % 4 in (1, 2)  # ABBA: off, on, on, off, ...
        for (cls, attr), wrapper in patched.items():
            setattr(cls, attr, wrapper if on else wrapper.__wrapped__)
        model.train_function = traced_fn if on else traced_fn.__wrapped__
        timer = timer_class()
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, callbacks=[timer])
        times["traced" if on else "untraced"].append(timer.times[0])
    for (cls, attr), wrapper in patched.items():
        setattr(cls, attr, wrapper)
    model.train_function = traced_fn
    return {"interleaved_epoch_s": times}


def run_once(traced: bool, args: argparse.Namespace, env: dict[str, str], workdir: Path, *,
             pause_s: float = 0.0, on_warm=None, interleave: int = 0, job: str = "bench") -> dict:  # noqa: ANN001
    cmd = [sys.executable, str(HERE), "--workload", "--steps", str(args.steps), "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--pause", str(pause_s), "--interleave", str(interleave),
           "--interleave-steps", str(args.interleave_steps)]
    if traced:
        cmd = [sys.executable, "-m", "opml_trace_collector.inject.run", "--job", job, "--", *cmd]
    process = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    result = None
    for line in process.stdout:
        if line.startswith("warm") and on_warm:
            on_warm()
        elif line.startswith("{"):
            result = json.loads(line)
    if process.wait() != 0 or result is None:
        raise RuntimeError(f"workload failed ({process.returncode}): {' '.join(cmd)}")
    return result


def hot_path_ns(iterations: int = 200_000) -> float:
    from opml_trace_collector.inject.recorder import TRAIN, Recorder
    recorder = Recorder()
    started = time.perf_counter()
    for _ in range(iterations):
        recorder.end(recorder.begin(), TRAIN, "keras.fit", 64)
        if len(recorder.steps) > 10_000:
            recorder.drain()
    return (time.perf_counter() - started) / iterations * 1e9


def spread(values: list[float]) -> dict:
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"mean": statistics.mean(values), "median": statistics.median(values), "p25": quartiles[0],
            "p75": quartiles[2], "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "mean_ci95": 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0}


def bench(args: argparse.Namespace) -> dict:
    import redis
    from opml.traces.v1 import events_pb2 as pb

    with tempfile.TemporaryDirectory(prefix="opml-bench-trace-") as tmp, _infra(tmp) as (env, platform):
        env = {**env, "OPML_TRACE_POLL_S": "0.2", "OPML_TRACE_BUCKET": f"{env['OPML_TOPIC_PREFIX']}traces"}
        per_step: dict[str, list[float]] = {"untraced": [], "traced": []}
        overheads = []
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            pair_result = {}
            for traced in order:
                epochs = run_once(traced, args, env, Path(tmp))["epoch_s"]
                pair_result[traced] = statistics.median(epochs) / args.steps
                per_step["traced" if traced else "untraced"].append(pair_result[traced])
            overheads.append(100 * (pair_result[True] / pair_result[False] - 1))
            print(f"pair {pair}: untraced {pair_result[False] * 1e3:.3f} ms/step, traced "
                  f"{pair_result[True] * 1e3:.3f} ms/step, overhead {overheads[-1]:+.2f}%", flush=True)

        inproc = run_once(True, args, env, Path(tmp), interleave=args.interleave)["interleaved_epoch_s"]
        pair_pct = [100 * (t / u - 1) for t, u in zip(inproc["traced"], inproc["untraced"], strict=True)]
        print(f"in-process interleaved: {len(pair_pct)} epoch pairs, overhead median {statistics.median(pair_pct):+.2f}%",
              flush=True)

        client = redis.Redis.from_url(env["OPML_REDIS_URL"])
        key = f"{env['OPML_REDIS_PREFIX']}traces:capture:bench-capture"
        arm = lambda: client.set(key, json.dumps({"capture_id": "bench", "steps": args.capture_steps}))  # noqa: E731
        capture_epochs = run_once(True, args, env, Path(tmp), pause_s=1.0, on_warm=arm, job="bench-capture")["epoch_s"]
        client.delete(key)
        events = asyncio.run(job_events(platform, "bench-capture"))
        completed = [(e, m) for e, m in events if isinstance(m, pb.CaptureCompleted)]
        capture = {"steps": args.capture_steps, "epoch_s": capture_epochs}
        if completed:
            event, done = completed[0]
            steps = {s.step: s for _, m in events if isinstance(m, pb.StepMetricsBatch) for s in m.steps
                     if s.kind == pb.STEP_KIND_TRAIN}
            last = steps[done.first_step + done.steps - 1]
            last_end = last.start_time.ToNanoseconds() / 1e9 + last.duration_s
            captured = range(done.first_step, done.first_step + done.steps)
            inside = [s.duration_s for n, s in steps.items() if n in captured]
            outside = [s.duration_s for n, s in steps.items() if n not in captured and n >= args.steps]
            capture.update(captured_step_ms_median=1e3 * statistics.median(inside),
                           other_step_ms_median=1e3 * statistics.median(outside))
            capture.update(size_bytes=done.size_bytes, event_count=done.event_count,
                           extra_epoch_ms=1e3 * (capture_epochs[0] - statistics.median(capture_epochs[1:])),
                           announce_after_last_step_s=event.time.timestamp() - last_end)
        else:
            capture["error"] = [m.reason for _, m in events if isinstance(m, pb.CaptureFailed)]
        untraced_step = statistics.median(per_step["untraced"])
        hot = hot_path_ns()
        return {
            "workload": {"model": "CNN conv16-conv32-dense64 on 28x28x1", "batch_size": args.batch_size,
                         "steps_per_epoch": args.steps, "timed_epochs": args.epochs, "pairs": args.pairs},
            "per_step_s": {arm_name: spread(v) for arm_name, v in per_step.items()},
            "process_ab": {"overhead_pct": spread(overheads), "overhead_pct_per_pair": overheads},
            "in_process_interleaved": {
                "epoch_pairs": len(pair_pct), "steps_per_epoch": args.interleave_steps,
                "per_step_s": {k: spread([t / args.interleave_steps for t in v])
                                                             for k, v in inproc.items()},
                "overhead_pct": spread(pair_pct), "overhead_pct_per_pair": pair_pct},
            "hot_path_ns_per_step": hot, "hot_path_pct_of_step": 100 * hot * 1e-9 / untraced_step,
            "capture": capture,
        }


def whole_process(args: argparse.Namespace) -> dict:
    """(4): CPU and wall of whole processes, untraced against traced, interleaved."""
    from opml_trace_collector.inject.launcher import build_env
    with tempfile.TemporaryDirectory(prefix="opml-bench-trace-") as tmp, _infra(tmp) as (env, _platform), \
            _shipper(env) as shipper:
        if args.tf_threads:
            threads = str(args.tf_threads)
            env = {**env, "TF_NUM_INTRAOP_THREADS": threads, "TF_NUM_INTEROP_THREADS": threads,
                   "OMP_NUM_THREADS": threads}
        traced_env = build_env("bench-whole", None, env)
        arms = {"untraced": env, "traced": traced_env}
        cpus = {args.cpu} if args.cpu is not None else None
        strata = [i * _FRAME_CHUNK_BYTES // args.stack_strata for i in range(args.stack_strata)] or [0]
        fault_cost_us = minor_fault_cost_us()
        results = {}
        for name, epochs, pairs in (("short", args.short_epochs, args.short_pairs),
                                    ("long", args.long_epochs, args.long_pairs)):
            if not pairs:
                continue
            cmd = [sys.executable, str(HERE), "--workload", "--steps", str(args.whole_steps), "--epochs", str(epochs),
                   "--batch-size", str(args.batch_size), "--interleave", "0"]
            solo = [_measured([cmd], [env], tmp, cpus)[0] for _ in range(args.solo_runs if args.concurrent else 0)]
            runs: dict[str, list[tuple[float, float]]] = {"untraced": [], "traced": []}
            thread_files = {arm: Path(tmp) / f"{name}-{arm}-threads.jsonl" for arm in runs}
            shipper_cpu: list[float] = []
            pads: list[int] = []
            for pair in range(pairs):
                pads.append(strata[pair % len(strata)])
                arm_cmds = {arm: [*cmd, "--out", str(thread_files[arm]), "--stack-pad", str(pads[-1])] for arm in runs}
                if args.untraced_keeps_chunks:
                    arm_cmds["untraced"].append("--keep-spare-chunks")
                # the arm started first alternates within each stratum as well as from pair to pair
                first = (pair + pair // len(strata)) % 2 if len(strata) % 2 == 0 else pair % 2
                order = ("untraced", "traced") if first == 0 else ("traced", "untraced")
                shipped_before = _cpu_of(shipper)
                if args.split_cpus:  # both arms at once, each on a CPU of its own; the CPUs swap each pair
                    pinned = [{args.split_cpus[0]}, {args.split_cpus[1]}] if pair % 4 < 2 else [
                        {args.split_cpus[1]}, {args.split_cpus[0]}]
                    measured = _measured([arm_cmds[a] for a in order], [arms[a] for a in order], tmp, pinned)
                    for arm, run in zip(order, measured, strict=True):
                        runs[arm].append(run)
                elif args.concurrent:  # both arms at once on the same CPU: the host's speed changes hit both
                    measured = _measured([arm_cmds[a] for a in order], [arms[a] for a in order], tmp, cpus)
                    for arm, run in zip(order, measured, strict=True):
                        runs[arm].append(run)
                else:
                    for arm in order:
                        runs[arm].append(_measured([arm_cmds[arm]], [arms[arm]], tmp, cpus)[0])
                if shipper is not None:
                    _wait_delivered(Path(env["OPML_TRACE_SPOOL_DIR"]))
                    shipper_cpu.append(_cpu_of(shipper) - shipped_before)
                print(f"{name} pair {pair}: untraced {runs['untraced'][-1][0]:.2f} s CPU, traced "
                      f"{runs['traced'][-1][0]:.2f} s CPU", flush=True)
            cpu_diff = [t[0] - u[0] for u, t in zip(runs["untraced"], runs["traced"], strict=True)]
            faults = _rows(thread_files, "minor_faults")
            reuses = _rows(thread_files, "chunk_reuses")
            wall_diff = [t[1] - u[1] for u, t in zip(runs["untraced"], runs["traced"], strict=True)]
            # The base of the percentages: the untraced job alone (in concurrent pairs each job's CPU is
            # inflated by sharing the core's caches, which would understate the percentage).
            base_cpu = statistics.median(c for c, _ in (solo or runs["untraced"]))
            cpu = spread(cpu_diff)
            with_shipper = spread([d + s for d, s in zip(cpu_diff, shipper_cpu, strict=True)]) if shipper_cpu else None
            results[name] = {
                "epochs": epochs, "steps_per_epoch": args.whole_steps, "pairs": pairs,
                "tf_threads": args.tf_threads or "default", "concurrent_pairs": args.concurrent, "cpu": args.cpu, "split_cpus": args.split_cpus,
                "stack_strata_bytes": strata, "untraced_keeps_chunks": args.untraced_keeps_chunks,
                "untraced_alone_cpu_s": spread([c for c, _ in solo]) if solo else None,
                "untraced_cpu_s": spread([c for c, _ in runs["untraced"]]),
                "traced_cpu_s": spread([c for c, _ in runs["traced"]]),
                "untraced_wall_s": spread([w for _, w in runs["untraced"]]),
                "traced_wall_s": spread([w for _, w in runs["traced"]]),
                "cpu_overhead_s": cpu, "wall_overhead_s": spread(wall_diff),
                "cpu_overhead_by_thread_s": _by_thread(thread_files),
                "minor_faults": _faults(faults, fault_cost_us, cpu_diff),
                "chunk_reuses": {arm: spread([float(n) for n in counts]) for arm, counts in reuses.items()},
                "by_stack_pad_bytes": _by_pad(pads, cpu_diff, faults, reuses),
                "shipper_cpu_per_traced_job_s": spread(shipper_cpu) if shipper_cpu else None,
                "cpu_overhead_pct": _pct(cpu, base_cpu),
                "cpu_overhead_with_shipper_pct": _pct(with_shipper, base_cpu) if with_shipper else None,
            }
        return results


def _rows(files: dict[str, Path], key: str) -> dict[str, list[dict]]:
    """Each arm's at-exit reports (one per run, in pair order): the ``key`` part."""
    return {arm: [json.loads(line)[key] for line in path.read_text().splitlines()] for arm, path in files.items()}


def _by_thread(files: dict[str, Path]) -> dict[str, dict]:
    """Per thread name, traced - untraced CPU per pair (mean, CI): where the whole-process difference is."""
    rows = _rows(files, "cpu_s")
    names = sorted({name for row in rows["traced"] + rows["untraced"] for name in row})
    return {name: spread([t.get(name, 0.0) - u.get(name, 0.0) for u, t in zip(rows["untraced"], rows["traced"],
                                                                              strict=True)])
            for name in names}


def _fault_difference(rows: dict[str, list[dict]], part: str = "process") -> list[float]:
    """Traced - untraced minor faults per pair, of the process or of the job's thread."""
    return [t[part] - u[part] for u, t in zip(rows["untraced"], rows["traced"], strict=True)]


def _faults(rows: dict[str, list[dict]], cost_us: float, cpu_diff: list[float]) -> dict:
    """Minor page faults of each arm and traced - untraced per pair; what a fault alone costs here
    (``cost_us``); and the pairs' CPU difference fitted on their fault difference (least squares):
    the slope is what the frame-chunk churn a fault marks costs (a chunk's mmap and munmap beside its
    faults), the intercept the CPU difference of a pair whose arms fault alike."""
    process = _fault_difference(rows)
    result = {"untraced": spread([r["process"] for r in rows["untraced"]]),
              "traced": spread([r["process"] for r in rows["traced"]]),
              "difference_per_pair": spread(process),
              "job_thread_difference_per_pair": spread(_fault_difference(rows, "job thread")),
              "cost_us_each": cost_us}
    n, mean_x, mean_y = len(process), statistics.mean(process), statistics.mean(cpu_diff)
    sxx = sum((x - mean_x) ** 2 for x in process)
    if n > 2 and sxx > 0:
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(process, cpu_diff, strict=True)) / sxx
        intercept = mean_y - slope * mean_x
        residual = (sum((y - intercept - slope * x) ** 2 for x, y in zip(process, cpu_diff, strict=True))
                    / (n - 2)) ** 0.5
        result["cpu_fit"] = {"us_per_fault": slope * 1e6, "cpu_s_at_equal_faults": intercept,
                             "cpu_s_at_equal_faults_ci95": 1.96 * residual * (1 / n + mean_x ** 2 / sxx) ** 0.5}
    return result


def _by_pad(pads: list[int], cpu_diff: list[float], rows: dict[str, list[dict]],
            reuses: dict[str, list[int]]) -> dict[str, dict]:
    """Per stack padding: traced - untraced CPU and minor faults of its pairs (each a draw of where the
    frame-chunk boundaries fall), and the chunk allocations kept chunks served in each arm."""
    faults = _fault_difference(rows)
    return {str(pad): {"pairs": pads.count(pad),
                       "cpu_overhead_s": spread([d for p, d in zip(pads, cpu_diff, strict=True) if p == pad]),
                       "minor_faults_difference": spread([f for p, f in zip(pads, faults, strict=True) if p == pad]),
                       "untraced_minor_faults": spread([r["process"] for p, r in zip(pads, rows["untraced"],
                                                                                      strict=True) if p == pad]),
                       "chunk_reuses": {arm: spread([float(n) for p, n in zip(pads, counts, strict=True) if p == pad])
                                        for arm, counts in reuses.items()}}
            for pad in sorted(set(pads))}


def _byte_compile() -> None:
    """Byte-compile what a traced job imports of ours, as a wheel install (and ``make install``) does:
    with PYTHONDONTWRITEBYTECODE set, an editable tree is otherwise compiled from source in every
    traced process, a cost (~25 ms of CPU) the untraced arm, all from compiled wheels, never pays."""
    import compileall

    import opml

    import opml_common
    import opml_trace_collector
    folders = [Path(opml_trace_collector.__file__).parent, Path(opml_common.__file__).parent,
               *(Path(p) for p in opml.__path__)]  # a namespace package: an editable install adds a hook entry
    for folder in folders:
        if folder.is_dir():
            compileall.compile_dir(folder, quiet=1)


def _pct(diff: dict, base: float) -> dict:
    return {"mean": 100 * diff["mean"] / base, "base_cpu_s": base,
            "ci95": [100 * (diff["mean"] - diff["mean_ci95"]) / base, 100 * (diff["mean"] + diff["mean_ci95"]) / base]}


def _measured(cmds: list[list[str]], envs: list[dict[str, str]], cwd: str, cpus: set[int] | list[set[int]] | None,
              ) -> list[tuple[float, float]]:
    """Runs the commands at once; (user + sys CPU of each process tree, its wall time), from wait4.
    ``cpus``: one set for all the commands, or a set per command."""
    started = time.perf_counter()
    per_command = cpus if isinstance(cpus, list) else [cpus] * len(cmds)
    processes = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  preexec_fn=(lambda c=c: os.sched_setaffinity(0, c)) if c else None)
                 for cmd, env, c in zip(cmds, envs, per_command, strict=True)]

    def reap(process: subprocess.Popen) -> tuple[float, float]:
        _, status, usage = os.wait4(process.pid, 0)  # blocks without the GIL: each process's own end
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            raise RuntimeError(f"workload failed ({process.returncode}): {' '.join(process.args)}")
        return usage.ru_utime + usage.ru_stime, time.perf_counter() - started

    with ThreadPoolExecutor(len(processes)) as pool:
        measured = list(pool.map(reap, processes))
    return measured


def fixed_workload(hold_s: float, out: Path) -> None:
    """(5)'s program: TensorFlow imported, a few steps, idle; at exit (after the tracer's own exit hook,
    which was registered later) writes the tracer threads' CPU and the job's wait in the tracer's exit."""
    import atexit
    import threading

    def report() -> None:
        import resource
        tracer = sys.modules.get("opml_trace_collector.inject.tracer")
        found = tracer._tracer if tracer else None
        threads = {t.name: time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                   for t in threading.enumerate() if t.name.startswith(("opml-tracer", "asyncio_"))}
        if found is not None and "opml-tracer" not in threads:  # the thread ends at exit now: its own last reading
            threads["opml-tracer"] = getattr(found, "thread_cpu_s", 0.0)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out.write_text(json.dumps({"thread_cpu_s": threads, "exit_s": found.exit_s if found else None,
                                   "startup_cpu_s": getattr(tracer, "startup_cpu_s", None),
                                   "main_thread_cpu_s": time.thread_time(),
                                   "process_cpu_s": usage.ru_utime + usage.ru_stime}))

    atexit.register(report)  # before TensorFlow's import: runs after the tracer's stop
    import tensorflow as tf
    variable = tf.Variable(1.0)

    @tf.function
    def step(x):  # noqa: ANN001, ANN202
        variable.assign_add(tf.reduce_sum(x))
        return variable

    for _ in range(20):
        step(tf.ones((8,)))
    time.sleep(hold_s)


def fixed_cost(args: argparse.Namespace) -> dict:
    """(5): the tracer's fixed cost per process, directly (thread clocks) and as a process difference."""
    import resource

    from opml_trace_collector.inject.launcher import build_env
    with tempfile.TemporaryDirectory(prefix="opml-bench-trace-") as tmp, _infra(tmp) as (env, platform), \
            _shipper(env) as shipper:
        traced_env = build_env("bench-fixed", None, env)
        out = Path(tmp) / "fixed.json"
        shipper_cpu: list[float] = []
        cmd = [sys.executable, str(HERE), "--fixed-workload", "--hold", str(args.hold), "--out", str(out)]
        cpu: dict[str, list[float]] = {"untraced": [], "traced": []}
        tracer_cpu, exits, startups = [], [], []
        # where the process's CPU went, per arm: the job's main thread, the tracer's threads, the rest
        # (TensorFlow's own thread pools), from the process's clocks at exit
        parts: dict[str, dict[str, list[float]]] = {arm: {"main": [], "tracer": [], "other": []}
                                                    for arm in ("untraced", "traced")}
        for pair in range(args.fixed_pairs):
            for arm in (("untraced", "traced") if pair % 2 == 0 else ("traced", "untraced")):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                shipped_before = _cpu_of(shipper)
                subprocess.run(cmd, env=traced_env if arm == "traced" else env, cwd=tmp, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu[arm].append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
                if shipper is not None and arm == "traced":  # the host's shipper: delivered, then its CPU read
                    _wait_delivered(Path(env["OPML_TRACE_SPOOL_DIR"]))
                    shipper_cpu.append(_cpu_of(shipper) - shipped_before)
                report = json.loads(out.read_text())
                mine = sum(report["thread_cpu_s"].values())
                parts[arm]["main"].append(report["main_thread_cpu_s"])
                parts[arm]["tracer"].append(mine)
                parts[arm]["other"].append(report["process_cpu_s"] - report["main_thread_cpu_s"] - mine)
                if arm == "traced":
                    tracer_cpu.append(mine)
                    exits.append(report["exit_s"])
                    startups.append(report["startup_cpu_s"])
            main = {arm: parts[arm]["main"][-1] for arm in parts}
            other = {arm: parts[arm]["other"][-1] for arm in parts}
            print(f"pair {pair}: main thread {main['untraced']:.2f} / {main['traced']:.2f} s, TensorFlow's threads "
                  f"{other['untraced']:.2f} / {other['traced']:.2f} s (untraced / traced)", flush=True)
            print(f"pair {pair}: untraced {cpu['untraced'][-1]:.2f} s, traced {cpu['traced'][-1]:.2f} s CPU; tracer "
                  f"threads {tracer_cpu[-1] * 1e3:.0f} ms CPU, exit wait {exits[-1] * 1e3:.0f} ms, start on the job's "
                  f"thread {(startups[-1] or 0) * 1e3:.1f} ms CPU", flush=True)
        diff = [t - u for u, t in zip(cpu["untraced"], cpu["traced"], strict=True)]
        shipped = None
        if shipper is not None:
            events = asyncio.run(count_events(platform, "bench-fixed"))
            shipped = {"cpu_per_traced_job_s": spread(shipper_cpu), "events": events,
                       "cpu_per_event_ms": 1e3 * sum(shipper_cpu) / events if events else None,
                       "note": "the shipper's CPU from the traced job's start until its spool folder was "
                               "delivered (its idle polling during that time included); not in the job's CPU"}
            print(f"shipper: {statistics.median(shipper_cpu) * 1e3:.0f} ms CPU per traced job (median), "
                  f"{events} events delivered", flush=True)
        return {"hold_s": args.hold, "pairs": args.fixed_pairs, "shipper": shipped,
                "untraced_cpu_s": spread(cpu["untraced"]), "traced_cpu_s": spread(cpu["traced"]),
                "process_cpu_overhead_s": spread(diff), "tracer_threads_cpu_s": spread(tracer_cpu),
                "job_exit_wait_s": spread(exits),
                "cpu_by_thread_s": {arm: {part: spread(v) for part, v in p.items()} for arm, p in parts.items()},
                "job_thread_start_cpu_s": spread(startups) if None not in startups else None}


@contextlib.contextmanager
def _shipper(env: dict[str, str]) -> Iterator[subprocess.Popen | None]:
    """The host's shipper for the bench's spool (None with a tree from before the shipper existed)."""
    import importlib.util
    if importlib.util.find_spec("opml_trace_collector.inject.ship") is None:
        yield None
        return
    process = subprocess.Popen([sys.executable, "-m", "opml_trace_collector.inject.ship", "--idle-exit-s", "0"],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield process
    finally:
        process.terminate()
        process.wait(30)


def _cpu_of(process: subprocess.Popen | None) -> float:
    """user + sys CPU seconds of a running child, from /proc."""
    if process is None:
        return 0.0
    fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_delivered(spool_dir: Path, timeout_s: float = 60) -> None:
    """Until no event file is left under ``spool_dir`` (the shipper delivered the last run)."""
    deadline = time.monotonic() + timeout_s
    while any(spool_dir.rglob("*.json")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shipper did not deliver {spool_dir} within {timeout_s} s")
        time.sleep(0.02)


async def count_events(settings: PlatformSettings, job: str, quiet_s: float = 3.0) -> int:
    """Distinct events of ``job`` in the traces topic (read until ``quiet_s`` pass without one)."""
    from aiokafka import AIOKafkaConsumer

    from opml_common.bus import CloudEvent
    from opml_trace_collector_contract.topics import TRACES
    consumer = AIOKafkaConsumer(TRACES.full_name(settings.topic_prefix), bootstrap_servers=settings.kafka_bootstrap,
                                group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    ids: set[str] = set()
    try:
        while batch := await consumer.getmany(timeout_ms=int(quiet_s * 1000)):
            for part in batch.values():
                for record in part:
                    event = CloudEvent.from_kafka(record.headers, record.value)
                    if event.subject and event.subject.startswith(job + "/"):
                        ids.add(event.id)
    finally:
        await consumer.stop()
    return len(ids)


async def job_events(settings: PlatformSettings, job: str, timeout_s: float = 60) -> list[tuple]:
    """(CloudEvent, message) of ``job`` from the traces topic, read until its TracerStopped."""
    from aiokafka import AIOKafkaConsumer
    from opml.traces.v1 import events_pb2 as pb

    from opml_common.bus import CloudEvent
    from opml_trace_collector_contract.topics import TRACES
    consumer = AIOKafkaConsumer(TRACES.full_name(settings.topic_prefix), bootstrap_servers=settings.kafka_bootstrap,
                                group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    events: list[tuple] = []
    try:
        deadline = time.monotonic() + timeout_s
        while not any(isinstance(m, pb.TracerStopped) for _, m in events) and time.monotonic() < deadline:
            for part in (await consumer.getmany(timeout_ms=300)).values():
                for record in part:
                    event = CloudEvent.from_kafka(record.headers, record.value)
                    message = event.parse(getattr(pb, event.type.rsplit(".", 1)[1]))
                    if message.job == job:
                        events.append((event, message))
    finally:
        await consumer.stop()
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="process pairs (untraced/traced runs)")
    parser.add_argument("--steps", type=int, default=20, help="batches per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per run (after one warm-up epoch)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--capture-steps", type=int, default=10)
    parser.add_argument("--interleave", type=int, default=60,
                        help="epoch pairs of the in-process interleaved comparison")
    parser.add_argument("--interleave-steps", type=int, default=5, help="steps per interleaved epoch")
    parser.add_argument("--whole", action="store_true", help="(4) only: whole-process CPU, short and long job")
    parser.add_argument("--whole-steps", type=int, default=100, help="(4): batches per epoch")
    parser.add_argument("--short-epochs", type=int, default=5, help="(4): epochs of the short (~10 s) job")
    parser.add_argument("--long-epochs", type=int, default=50, help="(4): epochs of the long (~60 s) job")
    parser.add_argument("--short-pairs", type=int, default=8, help="(4): interleaved pairs of the short job")
    parser.add_argument("--long-pairs", type=int, default=4, help="(4): interleaved pairs of the long job")
    parser.add_argument("--concurrent", action="store_true",
                        help="(4): run each pair's two arms at the same time on one CPU (see --cpu)")
    parser.add_argument("--cpu", type=int, default=None, help="(4): pin the workloads to this CPU")
    parser.add_argument("--split-cpus", type=lambda text: [int(c) for c in text.split(",")], default=None,
                        help="(4): run each pair's arms at once, each pinned to one of these two CPUs (e.g. 0,1), "
                             "swapping CPUs between pairs: no arm shares a CPU with the other")
    parser.add_argument("--solo-runs", type=int, default=3,
                        help="(4) with --concurrent: untraced runs alone, the base of the percentages")
    parser.add_argument("--tf-threads", type=int, default=0,
                        help="(4): TensorFlow intra-op/inter-op (and OpenMP) threads in both arms; 0: TensorFlow's default")
    parser.add_argument("--stack-strata", type=int, default=8,
                        help="(4): run pair p's job (both arms) beneath (p mod N) x 16 KiB / N bytes of frame stack; "
                             "0: no padding (one draw of CPython 3.11's frame-chunk boundaries)")
    parser.add_argument("--stack-pad", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--untraced-keeps-chunks", action="store_true",
                        help="(4): the untraced arm keeps freed frame-stack chunks as the traced one does "
                             "(inject/spare_chunks.py): the tracer's cost without the churn it saves")
    parser.add_argument("--keep-spare-chunks", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fixed", action="store_true", help="(5) only: the tracer's fixed cost per process")
    parser.add_argument("--fixed-pairs", type=int, default=10, help="(5): interleaved pairs")
    parser.add_argument("--hold", type=float, default=4.0, help="(5): seconds the program idles after its steps")
    parser.add_argument("--fixed-workload", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pause", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.workload:
        if args.out:
            _report_threads_at_exit(args.out)
        if args.keep_spare_chunks:
            from opml_trace_collector.inject.spare_chunks import keep_spare_chunks
            keep_spare_chunks()
        beneath_padding(args.stack_pad, lambda: workload(args.steps, args.epochs, args.batch_size, args.pause,
                                                         args.interleave, args.interleave_steps))
        return
    if args.fixed_workload:
        fixed_workload(args.hold, args.out)
        return
    _byte_compile()
    results = fixed_cost(args) if args.fixed else whole_process(args) if args.whole else bench(args)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
