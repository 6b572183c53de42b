"""The platform's main job, run by `make up` against the live stack: the vision-inspection story.

Four production lines inspect surfaces for scratches, spots and cracks (``inspection_data``). The
story's steps, each a module of ``story/`` run in order here, each printing what it does as it goes:

1. data (bundle-store): each line's daily spans committed as bundles tagged ``span`` and
   ``version``; line 1's pushed to S3, pulled into a second plant and verified byte for byte.
2. tune (automl-controller, job-orchestrator, trace-collector): a Katib experiment (TPE, median
   stop) over the spans, its trials traced TE jobs, their metrics from the Trace collector, the best
   trial's model committed and its job's traced runs and step metrics in the trace-collector.
3. train and bless (job-orchestrator, bundle-store, inference-router): a continuous training
   pipeline over the spans (ingest, validate, train warm, evaluate per line, bless, push with a
   rollout); the router serves what it pushed.
4. serve (inference-router, monitoring-scorer): the pipeline's model on the cpu and accel (int8)
   pools; the four lines' traffic through the KServe v2 front, each request with its ``line``, a share
   labelled late; the scorer's label-free estimates and their truth.
5. drift and alert (monitoring-scorer, bundle-store): line 3's lamps change; the day's span is
   committed; the scorer's estimate falls and it raises an alert, read back from the bus.
6. close the loop (job-orchestrator, inference-router, monitoring-scorer): the alert starts the
   pipeline, which retrains on the new span, blesses and pushes; the router rolls it out (shadow,
   canary, analyses) and promotes it; line 3's estimated and true accuracy come back.

At the end: a table of the steps (service, duration, outcome) and PNG plots in ``--out`` (the steps'
durations, the trials, each line's estimated and true accuracy with the alert, the rollout's traffic).
``--scale quick`` runs the same steps smaller (the tests' scale); ``full`` is `make up`'s, and
``OPML_MAIN_JOB_SCALE`` sets the default (`OPML_MAIN_JOB_SCALE=quick make up`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from story import data, drift, federated, lines, loop, pipeline, tune
from story.context import SCALES, Story
from story.summary import StepResult, plots, table

STEPS = (
    ("data", "bundle-store", data.run),
    ("tune", "automl-controller, job-orchestrator, trace-collector", tune.run),
    ("train and bless", "job-orchestrator (pipelines), bundle-store, inference-router", pipeline.run),
    ("serve", "inference-router, monitoring-scorer", lines.run),
    ("drift and alert", "monitoring-scorer, bundle-store", drift.run),
    ("close the loop", "job-orchestrator (pipelines), inference-router, monitoring-scorer", loop.run),
    ("federated", "fl-coordinator, bundle-store, inference-router", federated.run),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default=os.environ.get("OPML_MAIN_JOB_SCALE", "full"),
                        help="how big the story runs (default: $OPML_MAIN_JOB_SCALE, else full)")
    parser.add_argument("--out", type=Path, default=Path(".opml") / "main-job",
                        help="where the summary's plots go (default .opml/main-job)")
    args = parser.parse_args(argv)
    if args.scale not in SCALES:  # argparse checks the choices of given values only, not of a default
        parser.error(f"OPML_MAIN_JOB_SCALE: must be one of {', '.join(sorted(SCALES))}, not {args.scale!r}")
    results: list[StepResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o711)  # jobs' users may pass through to the folders made for them, and list nothing here
        story = Story(scale=SCALES[args.scale], workdir=Path(tmp), out=args.out)
        print(f"the vision-inspection story, scale {args.scale}", flush=True)
        for number, (name, services, step) in enumerate(STEPS, start=1):
            print(f"\n{number}. {name} ({services})", flush=True)
            started = time.monotonic()
            outcome = step(story)
            results.append(StepResult(number, name, services, time.monotonic() - started, outcome))
            print(f"   done in {results[-1].seconds:.1f} s: {outcome}", flush=True)
    written = plots(results, story.handed, args.out)
    print(f"\nsummary\n{table(results)}")
    print(f"plots: {', '.join(str(path) for path in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
