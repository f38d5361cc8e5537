"""The command line a newcomer reads: every option of every `unroll` command shows its whole name in `--help` on an
80-column terminal (typer's rich panel used to cut `--triton-metrics-port` to `--triton-metrics-…`), and
`make serve` passes options to `unroll serve` through ARGS."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
UNROLL = Path(sys.executable).parent / "unroll"


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command of the CLI (leaves and groups) with its path, from the Click tree typer builds."""
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


def _option_names(cmd: Any) -> list[str]:
    """The long and short names of a command's options (``--flag`` and its ``--no-flag`` form included)."""
    return [o for p in cmd.params if type(p).__name__.endswith("Option") for o in (*p.opts, *p.secondary_opts)]


def _all_commands() -> list[tuple[tuple[str, ...], list[str]]]:
    from unroll.app.cli import app

    return [(path, _option_names(cmd)) for path, cmd in _commands(typer.main.get_command(app))]


COMMANDS = _all_commands()


def test_every_command_is_checked() -> None:
    paths = {p for p, _ in COMMANDS}
    assert {("serve",), ("export",), ("bench", "soak"), ("doctor",)} <= paths, sorted(paths)


def test_the_readme_cli_table_names_every_command() -> None:
    """Each top-level command has its row in the docs' CLI table (docs/cli.md), and each ``unroll bench`` task is in
    the bench row: the table cannot forget a command (it forgot ``bench iters`` once)."""
    page = (ROOT / "docs" / "cli.md").read_text()
    table = page[page.index("## Commands"):page.index("Every command has a `--help`")]
    rows = [ln for ln in table.splitlines() if ln.startswith("| `unroll ")]
    firsts = {r.split("`")[1].split()[1] for r in rows}
    tops = {p[0] for p, _ in COMMANDS if len(p) == 1}
    assert tops <= firsts, sorted(tops - firsts)
    [bench] = [r for r in rows if r.startswith("| `unroll bench ")]
    listed = set(bench.split("`")[1].removeprefix("unroll bench ").replace("\\|", "|").split("|"))
    tasks = {p[1] for p, _ in COMMANDS if len(p) == 2 and p[0] == "bench"}
    assert tasks == listed, (sorted(tasks - listed), sorted(listed - tasks))


@pytest.mark.parametrize(("path", "names"), COMMANDS, ids=[" ".join(p) or "unroll" for p, _ in COMMANDS])
def test_help_at_80_columns_shows_every_option_name_whole(path: tuple[str, ...], names: list[str]) -> None:
    env = {**os.environ, "COLUMNS": "80", "TERMINAL_WIDTH": "80"}
    r = subprocess.run([str(UNROLL), *path, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert max(map(len, r.stdout.splitlines())) <= 80, r.stdout
    for name in [*names, "--help"]:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", r.stdout), \
            f"`unroll {' '.join(path)} --help` at 80 columns does not show {name} whole:\n{r.stdout}"
    cut = re.findall(r"(?<![\w-])--?\w[\w-]*…", r.stdout)
    assert not cut, f"option names cut short: {cut}\n{r.stdout}"


def test_make_serve_passes_args_to_unroll_serve() -> None:
    """`make serve ARGS="…"` reaches `unroll serve`: first shown by a dry run (so that a Makefile ignoring ARGS cannot
    start a real server here), then run for real with an unknown model, which `unroll serve` refuses by name
    before it builds or starts anything. ``-o .venv/.installed``: never reinstall the venv from a test."""
    args = "--models no-such-model --port 18081"
    make = ["make", "-s", "-o", ".venv/.installed", "serve", f"ARGS={args}"]
    dry = subprocess.run([*make[:1], "-n", *make[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"unroll serve {args}" in dry.stdout, dry.stdout
    r = subprocess.run(make, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")})
    assert r.returncode != 0
    assert "unknown model(s) no-such-model" in r.stderr, r.stdout + r.stderr


def test_make_help_lists_serve_and_its_args() -> None:
    r = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(r"make serve .*ARGS=", r.stdout) and "make test" in r.stdout, r.stdout


def test_unroll_serve_reads_its_models_from_unroll_models() -> None:
    """``UNROLL_MODELS`` (what ``UNROLL_MODELS=… make serve`` passes through) reaches `unroll serve`. A held Triton
    port makes a run that ignored it stop at its port check, so nothing is ever started here."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        base = {k: v for k, v in os.environ.items() if not k.startswith("UNROLL_")}
        cmd = [str(UNROLL), "serve", "--triton-http-port", str(held.getsockname()[1])]
        r = subprocess.run(cmd, env={**base, "UNROLL_MODELS": "no-such-model"}, cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1 and "unknown model(s) no-such-model" in r.stderr, r.stdout + r.stderr
