"""``unroll doctor``: what this machine can do, and which ``unroll`` commands will work here (and why not).

Every fact comes from running the thing or importing it (binaries with timeouts; native Python packages in child
interpreters, so one that crashes on import is reported instead of taking the doctor down; an execution provider
counts only once a session really ran on it). Each component is ``ok``, ``missing``, ``unusable``, ``broken`` or
``unknown``, and each command's verdict follows from the components it needs. Exit 0, except ``--require CMD``
for a command that cannot work here (1) or is unknown (2). The probes live in :mod:`unroll.machine`,
:mod:`.doctor_probes` and :mod:`.doctor_tools`, the verdicts in :mod:`.doctor_verdicts`; this module prints.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from unroll.app.doctor_verdicts import COMMANDS, DEFAULT_TIMEOUT_S, diagnose, resolve_command
from unroll.app.errors import fail, handles_errors
from unroll.errors import UsageError

MARKS = {"ok": "[green]✓[/]", "missing": "[dim]✗[/]", "unusable": "[yellow]✗[/]", "broken": "[bold red]✗[/]",
         "unknown": "[yellow]?[/]"}


def render(report: dict, console: Console) -> None:
    """The two tables (components, commands) and the time the check took."""
    comps = Table("", "component", "status", "what was found", title="What this machine has", title_justify="left")
    for c in report["components"].values():
        comps.add_row(MARKS[c["status"]], c["title"], c["status"], escape(c["summary"]))
    console.print(comps)
    cmds = Table("", "command", "why not / note", title="Which unroll commands work here", title_justify="left")
    for v in report["commands"]:
        text = v["reason"] if not v["ok"] else (v["note"] or "")
        cmds.add_row("[green]✓[/]" if v["ok"] else "[bold red]✗[/]", f"unroll {v['command']}"
                     if v["command"] != "container images" else v["command"], escape(text or ""))
    console.print(cmds)
    console.print(f"[dim]checked in {report['elapsed_s']:.1f} s (Python {report['python']}, {report['executable']})[/]")


@handles_errors
def doctor_command(
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON (components, commands)")] = False,
    require: Annotated[list[str] | None, typer.Option(
        "--require", help="Exit 1 unless this command can work here (repeatable), e.g. --require build, "
                          "--require 'bench models --device cuda'")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds all checks together may take (they run in parallel)")]
    = DEFAULT_TIMEOUT_S,
) -> None:
    """Report what this machine can do (GPU, driver, CUDA, TensorRT, ONNX Runtime providers, Triton, podman) and
    which unroll commands will work here, each with the reason when not.

    Every check runs the thing or imports it (in child processes with timeouts, so a broken component is
    reported, never fatal). Exit 0, or 1 when a --require'd command cannot work here.
    """
    err = Console(stderr=True)
    wanted = []
    for r in require or []:
        cmd = resolve_command(r)
        if cmd is None:
            raise UsageError(f"--require {r!r}: not a command doctor judges; one of: {', '.join(COMMANDS)}")
        wanted.append(cmd)
    if json_out:
        report = diagnose(timeout)
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        console = Console()
        with err.status("checking this machine"):
            report = diagnose(timeout)
        render(report, console)
    verdicts = {v["command"]: v for v in report["commands"]}
    failed = [verdicts[w] for w in wanted if not verdicts[w]["ok"]]
    exits = [fail(f"unroll {v['command']} cannot work here: {v['reason']}") for v in failed]  # one line each
    if exits:
        raise exits[0]


if __name__ == "__main__":
    typer.run(doctor_command)
