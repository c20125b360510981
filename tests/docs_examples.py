"""The docs' runnable examples: fenced blocks marked with an HTML comment on the line before them.

    <!-- runnable -->                  a bash block (or python: run with this Python), run as it is
    <!-- runnable file=train.py -->    the block is written to train.py, not run
    <!-- runnable expect="text" -->    its output (stdout + stderr) must also contain "text"

A page's runnable blocks run in order, in one fresh directory (a file written by one block is there for the
next). tests/integration/test_docs_site.py runs them against the installed nvrx; tests/unit/test_docs.py checks
that they are well formed. docs/development.md ("The docs") says the same for writers.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!--\s*runnable(?P<attrs>.*?)-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
LANGS = ("bash", "sh", "python")
# A rendezvous endpoint in an example is replaced by a free port when the test runs it (examples stay literal).
EXAMPLE_ENDPOINT = "127.0.0.1:29400"


@dataclass(frozen=True)
class Block:
    page: Path        # relative to the repository
    line: int         # of the marker, 1-based
    lang: str
    code: str
    file: str | None  # write the block here instead of running it
    expect: str | None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


class BadBlock(ValueError):
    """A runnable marker that is not followed by a fenced block, or with attributes the runner does not know."""


def parse(text: str, page: Path) -> list[Block]:
    lines = text.splitlines()
    out: list[Block] = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        attrs: dict[str, str] = {}
        for item in shlex.split(m.group("attrs")):
            key, sep, value = item.partition("=")
            if not sep or key not in ("file", "expect"):
                raise BadBlock(f"{page}:{i + 1}: unknown runnable attribute {item!r} (file=NAME, expect=TEXT)")
            attrs[key] = value
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None:
            raise BadBlock(f"{page}:{i + 1}: a runnable marker must be followed directly by a ``` fenced block")
        lang = fence.group("lang")
        if "file" not in attrs and lang not in LANGS:
            raise BadBlock(f"{page}:{i + 1}: a runnable {lang or 'untyped'} block must be bash or python, "
                           "or name a file=")
        try:
            end = next(j for j in range(i + 2, len(lines)) if lines[j].rstrip() == "```")
        except StopIteration:
            raise BadBlock(f"{page}:{i + 1}: the fenced block never ends") from None
        out.append(Block(page, i + 1, lang, "\n".join(lines[i + 2:end]) + "\n", attrs.get("file"),
                         attrs.get("expect")))
    return out


def doc_pages(root: Path = REPO) -> list[Path]:
    """README.md and every markdown page of the docs, relative to ROOT."""
    return [Path("README.md")] + sorted(p.relative_to(root) for p in (root / "docs").rglob("*.md"))


def runnable_pages(root: Path = REPO) -> dict[Path, list[Block]]:
    """Every page with runnable blocks -> its blocks, in order."""
    out = {}
    for rel in doc_pages(root):
        blocks = parse((root / rel).read_text(), rel)
        if blocks:
            out[rel] = blocks
    return out
