"""The rules of a file path inside a bundle, and where such a path may land on a local disk.

In the contract because both ends apply them: the store refuses a bundle whose paths break them,
and a client refuses to write a bundle the store (or anyone who could forge its answer) names with
such paths.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any

from opml_common.errors import InvalidArgument

MAX_PATH_LENGTH = 1024
MAX_SEGMENT_BYTES = 255

#: C0 controls (newlines and NUL included), DEL and C1 controls: never part of a bundle path.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

COLLISION_RULE = "paths in a bundle must not collide on any file system (case, Unicode form, a file and a " \
                 "directory of one name)"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate_bundle_path(value: Any, field: str = "path") -> str:
    """Raise InvalidArgument unless ``value`` is a file path inside a bundle.

    Rules: a non-empty string of at most 1024 characters, '/'-separated and relative (no leading
    '/'), with no empty, '.' or '..' segment, no segment over 255 bytes (UTF-8: the limit of
    ext4, APFS and NTFS), no backslash (a separator on Windows) and no control character (NUL,
    newlines and the rest of C0 and C1). Paths that only collide with others (case, Unicode
    normalisation, a file and a directory of one name) are :func:`validate_bundle_paths`' part.
    """
    rule = ("must be a relative '/'-separated path with no empty, '.' or '..' segments "
            f"(at most {MAX_PATH_LENGTH} characters)")
    if not isinstance(value, str) or not value:
        raise InvalidArgument(field, f"`{field}` {rule}, but got {_short(value)}.")
    if len(value) > MAX_PATH_LENGTH:
        raise InvalidArgument(field, f"`{field}` {rule}, but got {len(value)} characters: {_short(value)}.")
    control = _CONTROL.search(value)
    if control:
        raise InvalidArgument(
            field, f"`{field}` must not contain control characters (NUL, newlines, ...), but got "
                   f"{control.group()!r} in {_short(value)}.")
    if "\\" in value:
        raise InvalidArgument(
            field, f"`{field}` must use '/' as its only separator (no backslash), but got {_short(value)}.")
    if value.startswith("/"):
        raise InvalidArgument(field, f"`{field}` {rule}, but got the absolute path {_short(value)}.")
    for segment in value.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidArgument(
                field, f"`{field}` {rule}, but got {_short(value)} with the segment {segment!r}."
            )
        size = len(segment.encode("utf-8", "surrogatepass"))
        if size > MAX_SEGMENT_BYTES:
            raise InvalidArgument(
                field, f"`{field}` segments must be at most {MAX_SEGMENT_BYTES} bytes (UTF-8), but "
                       f"{_short(value)} has a segment of {size} bytes.")
    return value


def path_key(path: str) -> str:
    """The form in which two bundle paths collide on some file system: Unicode NFC, case folded
    (macOS and Windows fold case; macOS normalises names)."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", path).casefold())


class PathSet:
    """Bundle paths added so far, indexed so that each new one is checked for collisions in
    O(depth): same file after NFC and case folding, or a file and a directory of one name."""

    def __init__(self) -> None:
        self._files: dict[str, str] = {}  # path key -> the path
        self._directories: dict[str, str] = {}  # key of each directory some path lies in -> that path

    def collision(self, path: str) -> tuple[str, str] | None:
        """``(problem, other path)`` when ``path`` (a valid bundle path) collides with one added."""
        key = path_key(path)
        if (other := self._files.get(key)) is not None:
            if other == path:
                return "repeats", other
            return f"(code points {ascii(path)}) differs only in case or Unicode normalisation from", other
        if (other := self._directories.get(key)) is not None:
            return "is a file, but is a directory in", other
        segments = key.split("/")
        for end in range(1, len(segments)):
            if (other := self._files.get("/".join(segments[:end]))) is not None:
                return "needs a directory where there is a file in", other
        return None

    def add(self, path: str) -> None:
        key = path_key(path)
        self._files[key] = path
        segments = key.split("/")
        for end in range(1, len(segments)):
            self._directories.setdefault("/".join(segments[:end]), path)


def path_violations(paths: list[str], field: str = "files") -> list[tuple[str, str]]:
    """Every rule the bundle paths ``paths`` break, as ``(f"{field}[i].path", rule)`` pairs.

    Each path must pass :func:`validate_bundle_path`, and no two may land on the same file
    anywhere (:class:`PathSet`).
    """
    violations: list[tuple[str, str]] = []
    seen = PathSet()
    index_of: dict[str, int] = {}
    for index, path in enumerate(paths):
        name = f"{field}[{index}].path"
        try:
            validate_bundle_path(path, name)
        except InvalidArgument as exc:
            violations.extend(exc.violations)
            continue
        found = seen.collision(path)
        if found is not None:
            problem, other = found
            violations.append((name, f"`{name}` {_short(path)} {problem} `{field}[{index_of[other]}].path` "
                                     f"{_short(other)}: {COLLISION_RULE}"))
            continue
        seen.add(path)
        index_of.setdefault(path, index)
    return violations


def validate_bundle_paths(paths: list[str], field: str = "files") -> None:
    """Raise InvalidArgument naming every ``{field}[i].path`` that breaks :func:`path_violations`' rules."""
    violations = path_violations(paths, field)
    if violations:
        raise InvalidArgument.of(violations)


def contained(root: Path, relative: str) -> Path | None:
    """``root / relative`` resolved (symlinks followed), or None when that lands outside the
    resolved ``root``: an absolute ``relative``, a '..' climbing out, or a symlink under ``root``
    pointing elsewhere. Every local write of a path someone else chose goes through this."""
    base = root.resolve()
    if not relative or Path(relative).is_absolute():
        return None
    target = (base / relative).resolve()
    return target if target != base and target.is_relative_to(base) else None
