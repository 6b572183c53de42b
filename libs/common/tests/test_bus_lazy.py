"""``opml_common.bus`` loads its parts on first use: a publisher-only process (the injected tracer)
imports the producer and the outbox without the consumer, Redis or prometheus_client."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import opml_common.bus as bus


def test_publisher_and_outbox_import_without_consumer_redis_or_prometheus() -> None:
    code = ("import json, sys; import opml_common.bus.producer, opml_common.outbox; "
            "print(json.dumps(sorted(m for m in ('redis', 'prometheus_client', 'opml_common.metrics', "
            "'opml_common.bus.consumer', 'opml_common.bus.admin', 'opml_common.bus.dedup') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_every_public_name_still_resolves_and_unknown_ones_fail() -> None:
    from opml_common.bus.consumer import EventConsumer
    from opml_common.bus.producer import EventPublisher
    assert bus.EventConsumer is EventConsumer and bus.EventPublisher is EventPublisher
    assert all(getattr(bus, name) is not None for name in bus.__all__)
    assert set(bus.__all__) <= set(dir(bus))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        bus.Nope  # noqa: B018
