"""The README's shell examples as data: the ```bash blocks of a ``## `` section, split into commands, for the tests
that run them verbatim (``tests/test_readme_rest.py``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
#: A comment line showing what the command above it answers: ``# → {...}``.
ANSWER_MARK = "# →"


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
    """The ```bash blocks of the ``## `` section whose heading starts with ``heading`` (up to the next ``## ``)."""
    lines = (README.read_text() if text is None else text).splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(f"## {heading}")), None)
    if start is None:
        raise LookupError(f"README has no section '## {heading}'")
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
