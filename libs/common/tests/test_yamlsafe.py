"""The bounded YAML loader: each limit refuses before Python objects are built, with the field named."""

from __future__ import annotations

import tracemalloc

import pytest

from opml_common.errors import InvalidArgument
from opml_common.yamlsafe import DEFAULT_MAX_NODES, load_yaml


def alias_bomb(levels: int = 8, fanout: int = 10) -> str:
    """``fanout ** levels`` leaves in a few hundred bytes (the billion-laughs shape)."""
    lines = ["a: &a [" + ",".join(["lol"] * fanout) + "]"]
    for level in range(1, levels):
        lines.append(f"{level}: &{level} [" + ",".join([f"*{level - 1 or 'a'}"] * fanout) + "]")
    return "\n".join(lines) + "\n"


def test_plain_documents_load_like_safe_load() -> None:
    assert load_yaml("a: &x [1, 2]\nb: *x\nc: {d: 3.5, e: null, f: true}", what="t") == {
        "a": [1, 2], "b": [1, 2], "c": {"d": 3.5, "e": None, "f": True}}
    assert load_yaml(b'{"json": [1, "two"]}', what="t") == {"json": [1, "two"]}
    assert load_yaml("", what="t") is None


def test_an_alias_bomb_is_refused_while_composing_without_expanding_it() -> None:
    bomb = alias_bomb()
    assert len(bomb) < 430
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument) as caught:
            load_yaml(bomb, what="model.yaml")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.field == "model.yaml"
    assert f"more than {DEFAULT_MAX_NODES} nodes" in caught.value.message
    assert "line " in caught.value.message and "column " in caught.value.message
    assert peak < 4 << 20, f"composing the bomb used {peak} bytes: it was expanded"


def test_aliases_count_as_the_nodes_they_expand_to() -> None:
    document = "a: &a [1, 2, 3]\nb: [*a, *a, *a]\n"  # 1 + (1+3) + 1 + (1 + 3*4) = 20 nodes
    assert load_yaml(document, what="t", max_nodes=20)["b"] == [[1, 2, 3]] * 3
    with pytest.raises(InvalidArgument, match="more than 19 nodes"):
        load_yaml(document, what="t", max_nodes=19)


@pytest.mark.parametrize("document", [
    "[" * 50_000 + "]" * 50_000,
    "{a: " * 50_000 + "}" * 50_000,
    "- " * 5_000 + "x",
])
def test_deep_documents_are_refused_not_a_recursion_error(document: str) -> None:
    with pytest.raises(InvalidArgument, match=r"nests deeper than 64 levels at line \d+, column \d+") as caught:
        load_yaml(document, what="spec.yaml")
    assert caught.value.field == "spec.yaml"


def test_depth_counts_what_aliases_bring() -> None:
    document = "a: &a [[[1]]]\nb: [[*a]]\n"  # b's scalar: root, 2 sequences, then *a's 3 and its scalar
    assert load_yaml(document, what="t", max_depth=7)["b"] == [[[[[1]]]]]
    with pytest.raises(InvalidArgument, match="nests deeper than 6 levels"):
        load_yaml(document, what="t", max_depth=6)


def test_size_is_checked_before_parsing() -> None:
    with pytest.raises(InvalidArgument, match="at most 10 bytes of YAML, but has 11") as caught:
        load_yaml("a: [" + "1," * 3 + "1", what="bundle.yaml", max_bytes=10)
    assert caught.value.field == "bundle.yaml"
    with pytest.raises(InvalidArgument, match="at most 3 bytes"):
        load_yaml("é: 1"[:2] + "é", what="t", max_bytes=3)  # 2 characters, 5 bytes
    with pytest.raises(InvalidArgument, match="at most 3 bytes"):
        load_yaml(b"a: 12", what="t", max_bytes=3)


def test_a_cyclic_alias_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"alias \*a inside its own anchor"):
        load_yaml("&a [1, *a]", what="t")


@pytest.mark.parametrize(("document", "rule"), [
    ("a: [1, 2", r"is not valid YAML: expected ',' or '\]'.* at line 1, column 9"),
    ("a: *nope", r"undefined alias 'nope' at line 1, column 4"),
    ("a: 1\n---\nb: 2", r"found another document at line 2, column 1"),
    ("a: !!python/object:os.system x", r"could not determine a constructor .* at line 1, column 4"),
    ("a: " + "9" * 5_000, r"holds a value that cannot be read"),
])
def test_syntax_errors_name_the_document_line_and_column(document: str, rule: str) -> None:
    with pytest.raises(InvalidArgument, match=rule) as caught:
        load_yaml(document, what="models/m/model.yaml")
    assert caught.value.field == "models/m/model.yaml"


def test_bad_limits_are_a_programming_error() -> None:
    with pytest.raises(ValueError, match="max_nodes"):
        load_yaml("a: 1", what="t", max_nodes=0)
    with pytest.raises(InvalidArgument, match="must be YAML text, but got dict"):
        load_yaml({"a": 1}, what="t")  # type: ignore[arg-type]
