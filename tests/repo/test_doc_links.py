"""Every relative link and image in the repository's Markdown points at a file or folder of the repository.

Walks every tracked ``*.md`` (``git ls-files``), finds inline links and images (``[text](target)``,
``![alt](target)``) outside code blocks and code spans, and checks each relative target against the
file's own folder. Web and mail links (any ``scheme:``) and pure ``#anchor`` links are left out; for
``path#anchor`` the path is checked. A target must also stay inside the repository: a link out of it
(``../shared/...``) works on one machine and nowhere else.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets (an image inside a link)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+[\"'(][^)]*)?\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--", "*.md"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    return [ROOT / name for name in listed if name and (ROOT / name).is_file()]


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link and image outside fenced code and code spans."""
    found, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            found.append((number, match.group(1).strip("<>")))
    return found


def broken_target(source: Path, target: str) -> str | None:
    """Why ``target``, linked from ``source``, does not resolve; None when it does or is not a file link."""
    if not target or target.startswith("#") or SCHEME.match(target):
        return None
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    resolved = ((ROOT / path.lstrip("/")) if path.startswith("/") else (source.parent / path)).resolve()
    if not resolved.is_relative_to(ROOT):
        return "outside the repository"
    if not resolved.exists():
        return "no such file"
    return None


def test_links_finds_links_and_images_outside_code() -> None:
    text = ("See [a](docs/a.md), ![b](img/b.png \"title\") and [c](<with space.md#x>) and [web](https://x.org).\n"
            "`[not](a-link.md)` [anchor](#here)\n```\n[in](a-fence.md)\n```\n[after](docs/c.md)\n")
    assert links(text) == [(1, "docs/a.md"), (1, "img/b.png"), (1, "with space.md#x"), (1, "https://x.org"),
                           (2, "#here"), (6, "docs/c.md")]
    readme = ROOT / "README.md"
    assert broken_target(readme, "docs/benchmarks.md#goals") is None
    assert broken_target(readme, "https://example.org/missing.md") is None
    assert broken_target(readme, "mailto:someone@example.org") is None
    assert broken_target(readme, "#quick-start") is None
    assert broken_target(readme, "docs/no-such-page.md") == "no such file"
    assert broken_target(readme, "../shared/DESIGN.md") == "outside the repository"


def test_every_relative_doc_link_resolves() -> None:
    files = markdown_files()
    assert any(path.name == "README.md" for path in files), "git ls-files found the repository's Markdown"
    broken = [f"{path.relative_to(ROOT)}:{number}: ({target}) {why}"
              for path in files
              for number, target in links(path.read_text(encoding="utf-8"))
              if (why := broken_target(path, target))]
    assert not broken, f"{len(broken)} broken link(s) in the docs:\n" + "\n".join(broken)
