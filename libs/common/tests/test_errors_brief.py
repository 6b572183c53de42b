"""``brief``: a bounded repr for error messages, whatever the value's size or shape."""

from __future__ import annotations

from opml_common.errors import brief


def test_brief_is_short_and_never_builds_the_whole_repr() -> None:
    bomb: list = ["lol"] * 10
    for _ in range(8):
        bomb = [bomb] * 10  # 10^9 leaves, shared: what an expanded YAML alias bomb is
    cyclic: list = []
    cyclic.append(cyclic)
    values = [bomb, cyclic, {i: i for i in range(100_000)}, set(range(100_000)), "x" * 10_000_000,
              b"\0" * 10_000_000, bytearray(10_000_000), 10 ** 5000, list(range(1_000_000))]
    shown = [brief(value) for value in values]  # the full repr of the first would not finish
    assert all(len(text) <= 80 for text in shown), shown
    assert shown[7] == "<int of 16610 bits>"
    assert brief({"a": 1, "b": [1, 2]}) == "{'a': 1, 'b': [1, 2]}"
    assert brief("x" * 100, limit=10) == "'xxxxxx..."
