"""Reading a service's /metrics in tests, including the inference-router's re-exported worker families.

The router adds its workers' ``opml_inference_router_worker_*`` families to its page at scrape time and
leaves out a worker that is not up yet or did not answer within the collector's timeout (a loaded
machine), so one scrape may lack them: :func:`scrape_router` reads the page again until every known
worker is on it (each known worker has a ``worker_scrape_errors_total`` series from the start).
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from opml_devstack.testing.bus import poll_until

WORKER_PREFIX = "opml_inference_router_worker_"
SCRAPE_ERRORS = "opml_inference_router_worker_scrape_errors_total"


def scrape(port: int | str, *, timeout_s: float = 30.0) -> str:
    """The text of ``http://127.0.0.1:<port>/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as response:
        return response.read().decode()


def samples(text: str) -> list[Sample]:
    """Every sample of a /metrics page."""
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def every_worker_answered(text: str) -> bool:
    """True when each worker the router knows has series of its own on this page (it answered the scrape)."""
    page = samples(text)
    known = {sample.labels["worker"] for sample in page if sample.name == SCRAPE_ERRORS}
    answered = {sample.labels.get("worker") for sample in page
                if sample.name.startswith(WORKER_PREFIX) and not sample.name.startswith(SCRAPE_ERRORS)}
    return bool(known) and known <= answered


def scrape_router(port: int | str, *, timeout_s: float = 120.0) -> str:
    """The router's page once every known worker is on it (re-read until then, at most ``timeout_s``)."""
    pages: list[str] = []

    def answered() -> bool:
        pages.append(scrape(port))
        return every_worker_answered(pages[-1])

    poll_until(answered, timeout_s=timeout_s, what="every worker of the router on its /metrics", every_s=0.25)
    return pages[-1]
