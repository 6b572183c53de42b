"""The experiment's Optuna journal on a real Redis: a read that a delete overtakes ends instead of waiting forever."""

from __future__ import annotations

import pytest
import redis

from opml_automl_controller.study import DeletableJournal
from opml_common.errors import NotFound


def test_a_read_overtaken_by_the_journals_delete_ends(infra, run_redis_keys: str, unique_prefix: str) -> None:
    """What an experiment's delete does to a trial's report in flight: the journal (length and entries) is
    removed in one transaction after the read took its length; Optuna's own backend waited for the
    entries forever."""
    prefix = f"{run_redis_keys}{unique_prefix}journal"
    journal = DeletableJournal(infra.redis_url, prefix=prefix)
    journal.append_logs([{"op_code": 0, "n": i} for i in range(3)])
    reading = journal.read_logs(0)
    assert next(reading)["n"] == 0
    client = redis.Redis.from_url(infra.redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        assert len(keys) == 4  # the length and three entries
        client.delete(*keys)
        with pytest.raises(NotFound, match="was deleted while it was read"):
            next(reading)
        assert list(journal.read_logs(0)) == []  # a read after the delete finds no journal
    finally:
        client.close()
        journal._redis.close()


def test_a_whole_journal_reads_back_in_order(infra, run_redis_keys: str, unique_prefix: str) -> None:
    journal = DeletableJournal(infra.redis_url, prefix=f"{run_redis_keys}{unique_prefix}journal")
    try:
        journal.append_logs([{"op_code": 0, "n": i} for i in range(5)])
        assert [log["n"] for log in journal.read_logs(0)] == [0, 1, 2, 3, 4]
        assert [log["n"] for log in journal.read_logs(3)] == [3, 4]
    finally:
        journal._redis.close()  # its keys go with the session's (run_redis_keys)
