"""Continuous training pipelines (after TFX): DAGs of ingest, validate, train, evaluate, bless and
push steps over data spans in the bundle-store, run durably by the job-orchestrator, each step
cached by the content of its inputs.

One responsibility per module: :mod:`.dag` (the plan of a spec), :mod:`.spans` (which spans a run
reads), :mod:`.cache` (cache keys), :mod:`.store` (runs in Redis), :mod:`.bundles` (the bundle-store),
:mod:`.folders` (what a step's job reads and writes), :mod:`.steps` (steps' jobs), :mod:`.runner`
(one run, step by step), :mod:`.engine` (pipelines, one run at a time, coalesced triggers),
:mod:`.triggers` (events and schedules), :mod:`.servicer` and :mod:`.cli` (the API and ``opml pipeline``);
and the data steps' program the validate and evaluate jobs run, :mod:`.stepjobs` (over :mod:`.table`,
:mod:`.statistics`, :mod:`.schema`, :mod:`.anomalies`, :mod:`.evaluation`).
"""
