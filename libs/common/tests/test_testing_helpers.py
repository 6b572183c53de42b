"""The bounded waits tests rely on: they return what they waited for, and fail when it never comes."""

import pytest

from opml_common.testing.bus import poll_until


def test_poll_until_returns_the_first_truthy_value() -> None:
    answers = iter([None, [], ["ready"]])
    assert poll_until(lambda: next(answers), every_s=0.001) == ["ready"]


def test_poll_until_names_what_never_happened() -> None:
    with pytest.raises(AssertionError, match="timed out after 0.05s waiting for the impossible"):
        poll_until(lambda: None, timeout_s=0.05, every_s=0.01, what="the impossible")
