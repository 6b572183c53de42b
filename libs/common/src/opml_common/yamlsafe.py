"""One bounded YAML loader for every document a service reads from a client, a bundle or a file.

``yaml.safe_load`` refuses tags that run code, but not documents that cost far more than they
weigh: a 430-byte document of nested aliases expands to 10^8 leaves as soon as anything walks it
(validation, ``repr``), and a 50,000-deep one overflows the Python stack. :func:`load_yaml` bounds
the work *while composing*, before any Python object is built:

- the document's size (``max_bytes``), checked before parsing;
- the number of nodes (``max_nodes``), where an alias counts as every node it expands to, so an
  alias bomb is refused after a few hundred events, never expanded;
- the nesting depth (``max_depth``: nodes on a path from the root), aliases included, checked before the composer recurses one
  level deeper, so the stack stays shallow whatever the input.

Every refusal, and every YAML syntax error, is an :class:`~opml_common.errors.InvalidArgument`
whose field is ``what`` (the file or request field the text came from) and whose message gives the
line and column. Recursive aliases (``&a [*a]``) are refused too: they make cyclic objects.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.events import AliasEvent

from opml_common.errors import InvalidArgument

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_DEPTH", "DEFAULT_MAX_NODES", "load_yaml"]

DEFAULT_MAX_BYTES = 1 << 20
"""1 MiB: far more than any config or manifest the platform writes."""
DEFAULT_MAX_NODES = 100_000
"""Scalars, sequences and mappings, aliases counted as what they expand to."""
DEFAULT_MAX_DEPTH = 64
"""Nodes on the path from the root to the deepest one (the root is level 1, a scalar counts)."""


class _Refused(yaml.YAMLError):
    """A limit broken while composing; carries the position of the event that broke it."""

    def __init__(self, rule: str, mark: Any) -> None:
        super().__init__(rule)
        self.rule = rule
        self.mark = mark


class _BoundedLoader(yaml.SafeLoader):
    """``SafeLoader`` whose composer counts and bounds nodes and depth before building anything.

    ``_weights[anchor]`` is (nodes, height) of the anchored subtree as composed, aliases inside it
    already expanded, so an alias adds its whole expansion to the count in O(1).
    """

    def __init__(self, stream: Any, *, max_nodes: int, max_depth: int) -> None:
        super().__init__(stream)
        self._max_nodes = max_nodes
        self._max_depth = max_depth
        self._nodes = 0
        self._depth = 0
        self._deepest = 0
        self._weights: dict[str, tuple[int, int]] = {}

    def _count(self, nodes: int, reach: int, mark: Any) -> None:
        self._nodes += nodes
        if self._nodes > self._max_nodes:
            raise _Refused(
                f"has more than {self._max_nodes} nodes (aliases count as the nodes they expand to)", mark
            )
        if reach > self._max_depth:
            raise _Refused(f"nests deeper than {self._max_depth} levels", mark)
        self._deepest = max(self._deepest, reach)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            if event.anchor in self.anchors and event.anchor not in self._weights:
                raise _Refused(f"uses alias *{event.anchor} inside its own anchor (a cycle)", event.start_mark)
            nodes, height = self._weights.get(event.anchor, (0, 0))
            self._count(nodes, self._depth + height, event.start_mark)
            return super().compose_node(parent, index)
        anchor = event.anchor
        before_nodes, outer_deepest = self._nodes, self._deepest
        self._depth += 1
        self._deepest = self._depth
        self._count(1, self._depth, event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        height = self._deepest - self._depth
        if anchor is not None:
            self._weights[anchor] = (self._nodes - before_nodes, height)
        self._deepest = max(outer_deepest, self._deepest)
        return node

    def compose_document(self) -> Any:
        node = super().compose_document()
        self._weights = {}
        return node


def load_yaml(
    text_or_bytes: str | bytes,
    *,
    what: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_nodes: int = DEFAULT_MAX_NODES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Any:
    """Parses one YAML (or JSON) document with ``SafeLoader``'s types, within the given bounds.

    Args:
        text_or_bytes: the document; bytes may carry a UTF-8/16 BOM.
        what: the file or field the document came from; it is the error's field.
        max_bytes: largest document accepted (UTF-8 bytes for text).
        max_nodes: most nodes, aliases counted as the nodes they expand to.
        max_depth: most nodes on any path from the root (scalars count), aliases included.

    Returns:
        The document's value (``None`` for an empty document).

    Raises:
        InvalidArgument: field ``what``: the document is too large, too deep, has too many
            nodes, a cyclic alias, is not valid YAML (line and column given), or holds a scalar
            that cannot be converted (an integer of more than 4300 digits, a bad timestamp).
    """
    for name, limit in (("max_bytes", max_bytes), ("max_nodes", max_nodes), ("max_depth", max_depth)):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"`{name}` must be an int >= 1, but got {limit!r}")
    if not isinstance(text_or_bytes, (str, bytes, bytearray, memoryview)):
        raise InvalidArgument(what, f"must be YAML text, but got {type(text_or_bytes).__name__}")
    if isinstance(text_or_bytes, str):
        size = len(text_or_bytes)  # a lower bound of its UTF-8 size, free to take
        if size <= max_bytes:
            size = len(text_or_bytes.encode("utf-8", "surrogatepass"))
    else:
        size = memoryview(text_or_bytes).nbytes
    if size > max_bytes:
        raise InvalidArgument(what, f"must be at most {max_bytes} bytes of YAML, but has {size}")
    document = bytes(text_or_bytes) if isinstance(text_or_bytes, (bytearray, memoryview)) else text_or_bytes
    loader = _BoundedLoader(document, max_nodes=max_nodes, max_depth=max_depth)
    try:
        return loader.get_single_data()
    except _Refused as error:
        raise InvalidArgument(what, f"{error.rule}{_at(error.mark)}") from None
    except yaml.MarkedYAMLError as error:
        problem = error.problem or error.context or "is not valid YAML"
        raise InvalidArgument(what, f"is not valid YAML: {problem}{_at(error.problem_mark)}") from None
    except yaml.YAMLError as error:
        raise InvalidArgument(what, f"is not valid YAML: {str(error)[:200]}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as error:
        # Scalar conversions (int() past Python's digit limit, bad dates) raise these.
        raise InvalidArgument(what, f"holds a value that cannot be read: {str(error)[:200]}") from None
    finally:
        loader.dispose()


def _at(mark: Any) -> str:
    if mark is None:
        return ""
    return f" at line {mark.line + 1}, column {mark.column + 1}"
