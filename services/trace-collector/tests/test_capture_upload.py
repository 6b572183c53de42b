"""A finished capture's upload while S3 cannot be reached: retried with backoff for a bounded time,
S3's own refusals not retried (pure logic; the real outage is tests/integration/test_outage_s3.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import urllib3
from minio.error import S3Error

from opml_trace_collector.inject import capture


class FlakyS3:
    """Refuses connections ``down`` times, then stores; records what it was asked."""

    def __init__(self, down: int, error: Exception | None = None) -> None:
        self.down = down
        self.error = error or urllib3.exceptions.MaxRetryError(None, "/", reason="connection refused")
        self.puts: list[tuple[str, str, str]] = []

    def bucket_exists(self, bucket: str) -> bool:
        if self.down:
            self.down -= 1
            raise self.error
        return True

    def fput_object(self, bucket: str, key: str, path: str, content_type: str) -> None:
        self.puts.append((bucket, key, Path(path).read_text()))


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.json.gz"
    path.write_text("the trace")
    return path


def test_an_unreachable_s3_is_retried_with_backoff_until_the_upload_succeeds(trace: Path) -> None:
    s3, waits, told = FlakyS3(down=4), [], []
    capture.upload(s3, "b", "traces/j/c/w.trace.json.gz", trace, retry_for_s=600,
                   on_retry=lambda attempt, error, delay: told.append((attempt, type(error).__name__, delay)),
                   sleep=waits.append)
    assert s3.puts == [("b", "traces/j/c/w.trace.json.gz", "the trace")]
    assert waits == [0.5, 1.0, 2.0, 4.0]  # capped exponential backoff
    assert told == [(n, "MaxRetryError", d) for n, d in zip(range(1, 5), waits, strict=True)]


def test_the_retries_stop_once_the_retry_time_is_spent(trace: Path) -> None:
    s3, waits = FlakyS3(down=1000), []
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        capture.upload(s3, "b", "k", trace, retry_for_s=3.0, sleep=waits.append, clock=lambda: sum(waits))
    assert waits == [0.5, 1.0]  # a third wait (2 s) would start past 3 s: the upload gives up
    assert s3.puts == []
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        capture.upload(FlakyS3(down=1), "b", "k", trace, retry_for_s=0, sleep=waits.append)


def test_a_refusal_by_s3_is_not_retried(trace: Path) -> None:
    denied = S3Error(None, "AccessDenied", "Access Denied.", "/b", "r", "h")
    s3, waits = FlakyS3(down=1, error=denied), []
    with pytest.raises(S3Error):
        capture.upload(s3, "b", "k", trace, retry_for_s=600, sleep=waits.append)
    assert waits == []
