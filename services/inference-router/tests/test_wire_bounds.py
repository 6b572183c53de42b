"""The router's header walk visits a bounded number of fields (issue 16, item 3)."""

from __future__ import annotations

import numpy as np
import pytest

from opml_inference_router.kserve import encode_request
from opml_inference_router.routing import wire


def test_tiny_unknown_fields_past_the_cap_are_refused_without_walking_them() -> None:
    head = encode_request("m", {"x": np.zeros((1, 4), np.float32)}, version="2").SerializeToString()
    bomb = head + b"\x78\x00" * (62 * 1024 * 1024 // 2)  # 62 MiB of field 15 varints
    with pytest.raises(wire.MalformedMessage, match=r"more than 4096 top-level fields.*stopped at byte \d+ of"):
        wire.read_header(bomb)
    assert wire.read_header(head + b"\x78\x00" * 100) == ("m", "2", "")
    with pytest.raises(wire.MalformedMessage, match="more than 3 top-level fields"):
        wire.read_header(head + b"\x78\x00", max_fields=3)


def test_a_large_unknown_length_delimited_field_is_skipped_in_one_step() -> None:
    big = b"\x7a" + bytes([0x80, 0x80, 0x80, 0x1e]) + b"\0" * (60 << 20)  # field 15, 60 MiB, one field
    header = wire.read_header(wire.encode_field(1, "m") + big, max_fields=2)
    assert header.model_name == "m"
