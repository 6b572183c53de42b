"""Every test runs its real path: the platform's pytest plugin fails a skipped test with its reason."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def test_a_skipped_test_fails_with_its_reason(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_skipping="""
        import pytest

        def test_skips_by_call():
            pytest.skip("no GPU here")

        @pytest.mark.skip(reason="flaky")
        def test_skips_by_mark():
            pass

        def test_runs():
            pass
    """)
    result = pytester.runpytest_subprocess()  # the opml_infra plugin loads by its entry point
    result.assert_outcomes(passed=1, failed=1, errors=1)  # a skip mark acts in setup: an error there
    for reason in ("no GPU here", "flaky"):
        result.stdout.fnmatch_lines([f"skipped ({reason}): a skipped test proves nothing*"])
