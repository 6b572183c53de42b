"""The direct data plane: the native front sends a call straight to a worker, without the router's hop.

Why: through the router a request crosses three processes (front, router, worker) and wakes each
twice; the router's share was ~0.09-0.27 ms of CPU a request (docs/benchmarks.md, *Serving tail*).
Here the router stays the one place that decides, and the front carries out its decisions:

- :class:`~.push.DirectPlane` pushes the front a route table over the front's link: per model, the
  version that takes all its traffic, its size limit, default deadline and hedging; per replica, the
  worker's Unix socket, the admission tokens leased to the front (slots of the model's concurrency
  limiter the router holds for it) and the hedge delay (the replica's p95). Pushed again when it
  changes (ejections, replicas, leases, latencies), every ``interval_s`` at most.
- Auth: the first call of a credential goes through the router, which checks it and pushes the
  verdict with a TTL; the front lets that credential's later calls through without asking.
- The front reports each call in batches (frames kind :data:`~..frames.REPORT`): the router feeds its
  metrics, the replicas' latency windows and ejections, the admission limiter, the rollouts' outcome
  windows and the prediction log (the request and response bytes: every prediction is published).

Anything else goes through the router as before: a model in a canary or rollout split, one with a
shadow, a version the caller names that is not the routed one, a model with no routable local
replica, a caller without a verdict, no token left, and every retry after a replica failed.
"""

from opml_inference_router.data_plane.push import DirectPlane

__all__ = ["DirectPlane"]
