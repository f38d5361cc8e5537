"""The shell examples of the README and the docs site as data: the ```bash blocks of a ``## `` section, split into
commands, for the tests that run them verbatim (``tests/test_readme_rest.py`` and the others naming a section), the
generated blocks between a benchmark's markers, and every fenced block with the comment above it (what
``tests/test_docs.py`` holds each shell and Python block to: run by a named test, or a stated reason why not)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from unroll.benchmarks.common import docs_pages

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: A comment line showing what the command above it answers: ``# → {...}``.
ANSWER_MARK = "# →"


def pages() -> list[Path]:
    """The README and every page of the docs site (not the folders docs/ links in)."""
    return docs_pages(ROOT)


def page_with(text: str) -> Path:
    """The one page holding ``text`` (a ``## `` heading line or a generated block's marker)."""
    found = [p for p in pages() if text in p.read_text(encoding="utf-8")]
    if len(found) != 1:
        raise LookupError(f"{len(found)} pages hold {text!r} (README.md and docs/): {[str(p) for p in found]}")
    return found[0]


def generated(begin: str, end: str) -> list[str]:
    """The text between ``begin`` and ``end`` on every page that holds them (at least one)."""
    blocks = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        if begin in text:
            blocks.append(text[text.index(begin) + len(begin):text.index(end)].strip())
    if not blocks:
        raise LookupError(f"no page of README.md or docs/ holds {begin!r}")
    return blocks


@dataclass(frozen=True)
class Command:
    """One shell command of a block (continuation lines joined), with the answer the README shows for it."""

    text: str
    answer: str | None = None


@dataclass(frozen=True)
class Block:
    """A ```bash block: the ``### `` subsection it sits in (``""`` before any) and its commands and comments."""

    subsection: str
    commands: list[Command] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)


def section(heading: str, text: str | None = None) -> list[Block]:
    """The ```bash blocks of the ``## `` section whose heading starts with ``heading`` (up to the next ``## ``), on
    whichever page of the README and docs/ has it (``text``: that page's text, given)."""
    if text is None:
        page = next((p for p in pages() if any(ln.startswith(f"## {heading}")
                                               for ln in p.read_text(encoding="utf-8").splitlines())), None)
        if page is None:
            raise LookupError(f"no page of README.md or docs/ has a section '## {heading}'")
        text = page.read_text(encoding="utf-8")
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(f"## {heading}")), None)
    if start is None:
        raise LookupError(f"no section '## {heading}'")
    blocks: list[Block] = []
    subsection, body = "", None
    for ln in lines[start + 1:]:
        if body is None and ln.startswith("## "):
            break
        if body is None and ln.startswith("### "):
            subsection = ln[4:].strip()
        elif body is None and ln.strip() in ("```bash", "```sh", "```shell"):
            body = []
        elif body is not None and ln.strip() == "```":
            blocks.append(parse_block(subsection, body))
            body = None
        elif body is not None:
            body.append(ln)
    return blocks


@dataclass(frozen=True)
class Fence:
    """A fenced block of a page: where it starts (1-based line), its language, and the comment line above it
    (``<!-- … -->``'s inside, or ``None``)."""

    page: Path
    line: int
    language: str
    note: str | None


def fences(page: Path) -> list[Fence]:
    """Every fenced block of ``page`` (``` or ~~~, any language; unlabelled ones as ``text``)."""
    found, inside = [], None
    lines = page.read_text(encoding="utf-8").splitlines()
    for i, ln in enumerate(lines):
        stripped = ln.strip()
        if inside is None and (stripped.startswith("```") or stripped.startswith("~~~")):
            inside = stripped[:3]
            above = lines[i - 1].strip() if i else ""
            note = above[4:-3].strip() if above.startswith("<!--") and above.endswith("-->") else None
            found.append(Fence(page, i + 1, stripped[3:].strip().split(" ")[0] or "text", note))
        elif inside is not None and stripped == inside:
            inside = None
    return found


def parse_block(subsection: str, lines: list[str]) -> Block:
    """Commands (``\\`` continuations joined, comments kept: bash ignores them) and the block's comment lines."""
    block = Block(subsection)
    pending = ""
    for ln in lines:
        if pending:
            pending += " " + ln.strip()
        elif ln.strip().startswith(ANSWER_MARK) and block.commands:
            block.commands[-1] = Command(block.commands[-1].text, ln.strip()[len(ANSWER_MARK):].strip())
            continue
        elif ln.strip().startswith("#") or not ln.strip():
            if ln.strip():
                block.comments.append(ln.strip())
            continue
        else:
            pending = ln.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        block.commands.append(Command(pending))
        pending = ""
    if pending:
        block.commands.append(Command(pending))
    return block


def split_comment(command: str) -> tuple[str, str]:
    """``(code, comment)``: the command before a trailing ``# comment`` (outside quotes), and that comment."""
    quote = ""
    for i, ch in enumerate(command):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i], command[i + 1:].strip()
    return command, ""


def without_comment(command: str) -> str:
    """The command without a trailing ``# comment`` and with runs of blanks made one space."""
    return re.sub(r"\s+", " ", split_comment(command)[0]).strip()
