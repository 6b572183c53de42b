"""The bounded waits tests rely on: they return what they waited for, and fail when it never comes."""

import pytest

from opml_common.testing.bus import poll_until


def test_poll_until_returns_the_first_truthy_value() -> None:
    answers = iter([None, [], ["ready"]])
    assert poll_until(lambda: next(answers), every_s=0.001) == ["ready"]


def test_poll_until_names_what_never_happened() -> None:
    with pytest.raises(AssertionError, match="timed out after 0.05s waiting for the impossible"):
        poll_until(lambda: None, timeout_s=0.05, every_s=0.01, what="the impossible")


def test_every_worker_answered_needs_each_known_worker_on_the_page() -> None:
    from opml_common.testing.metrics import every_worker_answered

    errors = ('opml_inference_router_worker_scrape_errors_total{worker="cpu-000"} 0\n'
              'opml_inference_router_worker_scrape_errors_total{worker="cpu-001"} 0\n')
    one = 'opml_inference_router_worker_batch_size_count{worker="cpu-000",pool_kind="cpu"} 3\n'
    two = 'opml_inference_router_worker_batch_size_count{worker="cpu-001",pool_kind="cpu"} 1\n'
    assert not every_worker_answered(errors)  # known, but none answered this scrape
    assert not every_worker_answered(errors + one)
    assert every_worker_answered(errors + one + two)
    assert not every_worker_answered(one)  # no known worker: a page without the router's collector
