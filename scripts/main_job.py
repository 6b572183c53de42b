"""The platform's main job, run by `make up` against the live stack: the vision-inspection story.

Four production lines inspect surfaces for scratches, spots and cracks (``inspection_data``). The
story's steps, each a module of ``story/`` run in order here, each printing what it does as it goes:

1. data (bundle-store): each line's daily spans committed as bundles tagged ``span`` and
   ``version``; line 1's pushed to S3, pulled into a second plant and verified byte for byte.
2. tune (automl-controller, job-orchestrator, trace-collector): a Katib experiment (TPE, median
   stop) over the spans, its trials traced TE jobs, their metrics from the Trace collector, the best
   trial's model committed.
3. train and bless (job-orchestrator, bundle-store, inference-router): a continuous training
   pipeline over the spans (ingest, validate, train warm, evaluate per line, bless, push with a
   rollout); the router serves what it pushed.
4. traced job (job-orchestrator, trace-collector, inference-router, monitoring-scorer): a CNN on the
   full-size patches trained as a traced TE job, its step metrics, committed with its reference set
   and monitoring rules, deployed by the router, a prediction over KServe v2 and its event.

At the end: a table of the steps (service, duration, outcome) and PNG plots in ``--out``.
``--scale quick`` runs the same steps smaller (the tests' scale); ``full`` is `make up`'s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from story import data, federated, pipeline, serve, tune
from story.context import SCALES, Story
from story.summary import StepResult, plots, table

STEPS = (
    ("data", "bundle-store", data.run),
    ("tune", "automl-controller, job-orchestrator, trace-collector", tune.run),
    ("train and bless", "job-orchestrator (pipelines), bundle-store, inference-router", pipeline.run),
    ("traced job", "job-orchestrator, trace-collector, inference-router", serve.run),
    ("federated", "fl-coordinator, bundle-store, inference-router", federated.run),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="full")
    parser.add_argument("--out", type=Path, default=Path(".opml") / "main-job",
                        help="where the summary's plots go (default .opml/main-job)")
    args = parser.parse_args(argv)
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
    written = plots(results, story.handed.get("trials", []), args.out)
    print(f"\nsummary\n{table(results)}")
    print(f"plots: {', '.join(str(path) for path in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
