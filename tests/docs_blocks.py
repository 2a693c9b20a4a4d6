"""The code blocks of README.md and docs/*.md, by the marker on the line before each fence
(`<!-- run: NAME -->`, or `<!-- newcomer: NAME -->` for the quick starts): the tests that run
them take them from the Markdown, so a block that stops running fails a test."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(?:<!-- (?P<kind>run|newcomer): (?P<name>[\w-]+) -->\n)?"
                    r"```(?P<lang>\w*)\n(?P<code>.*?)```\n", re.S)


@dataclass(frozen=True)
class Block:
    path: Path  # the Markdown file
    line: int  # its opening fence's line
    lang: str
    code: str
    marker: str | None  # "run: NAME" / "newcomer: NAME", or None


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks() -> list[Block]:
    """Every fenced code block of the README and the docs pages, in order."""
    out = []
    for path in markdown_files():
        text = path.read_text()
        for m in _BLOCK.finditer(text):
            fence = m.start("lang") - 3
            marker = f"{m['kind']}: {m['name']}" if m["kind"] else None
            out.append(Block(path, text.count("\n", 0, fence) + 1, m["lang"], m["code"], marker))
    return out


def block(marker: str) -> str:
    """The code of the one block marked `marker` (e.g. "run: serve-command")."""
    found = [b.code for b in blocks() if b.marker == marker]
    if len(found) != 1:
        raise LookupError(f"{len(found)} code blocks marked <!-- {marker} --> in README.md "
                          f"and docs/ (want exactly one)")
    return found[0]
