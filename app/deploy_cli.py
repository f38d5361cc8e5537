"""``unroll deploy NAME``: a new version of a served model into the running Triton, gated, without a restart.

The work is :mod:`unroll.pipeline.rollout`'s; this module is its command line: where Triton and its repository are,
the key ``unroll serve`` wrote, and the outcome as text or JSON.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated

import typer

from unroll import artifacts
from unroll.app.errors import fail, handles_errors
from unroll.serving.gateway.triton_client import TRITON_API_KEY_ENV
from unroll.serving.running import read_state

#: Where ``unroll deploy`` finds Triton's HTTP endpoint when ``--triton-url`` is not given.
TRITON_HTTP_URL_ENV = "UNROLL_TRITON_HTTP_URL"
#: Where it looks last: the port `unroll serve` gives Triton by default.
DEFAULT_TRITON_HTTP = "127.0.0.1:8000"


def triton_key(key: str | None, key_file: Path) -> str | None:
    """The key of the Triton to talk to: given, else ``key_file`` (``unroll serve`` writes it), else none."""
    if key:
        return key
    if key_file.is_file():
        return key_file.read_text().strip() or None
    return None


def find_triton(given: str | None, state_file: Path) -> tuple[str, str]:
    """Triton's HTTP address (with a warm standby: both, comma-separated) and how it was found: ``--triton-url``
    (or its variable), else the running ``unroll serve``'s state file, else the default port."""
    if given:
        return given, f"--triton-url/{TRITON_HTTP_URL_ENV}"
    state = read_state(state_file)
    if state is not None:
        urls = [state.triton_http] + ([state.standby_http] if state.standby_http else [])
        return ",".join(urls), f"{state_file} (unroll serve, pid {state.pid})"
    why = "stale: its unroll serve is gone" if state_file.is_file() else "missing: no unroll serve runs from here"
    return DEFAULT_TRITON_HTTP, f"the default port ({state_file} {why})"


@handles_errors
def deploy(
    name: Annotated[str, typer.Argument(help="The served model (its directory in --repo)")],
    graph: Annotated[Path | None, typer.Option(
        help="The new version's ONNX graph; it must carry the served model's card (same inputs, outputs, labels, "
             "knobs). Default: --onnx-dir/NAME.onnx, i.e. what `unroll export` last wrote")] = None,
    version: Annotated[int | None, typer.Option(min=1, help="Version number (default: the newest on disk + 1)")]
    = None,
    canary: Annotated[float | None, typer.Option(
        help="Send only this percentage of the model's requests to the new version and keep the rest on the live "
             "one; end it with --promote or --rollback. Default: all traffic once the gate passes")] = None,
    promote: Annotated[bool, typer.Option("--promote", help="End a canary: the new version takes all traffic, "
                                                            "the old one drains and is unloaded")] = False,
    rollback: Annotated[bool, typer.Option("--rollback", help="End a canary: the old version takes all traffic "
                                                              "back, the canary is unloaded and removed")] = False,
    triton_url: Annotated[str | None, typer.Option(
        envvar=TRITON_HTTP_URL_ENV, show_envvar=True,
        help="Triton's HTTP address (HOST:PORT; with a warm standby both, comma-separated: every load goes to "
             "each); its model control must be explicit, as `unroll serve` starts it. "
             f"Default: the Triton of the `unroll serve` running from this folder ({artifacts.SERVE_STATE}, whatever "
             f"ports it was given), else {DEFAULT_TRITON_HTTP}")] = None,
    triton_key_file: Annotated[Path, typer.Option(
        help=f"Where the key of the Triton `unroll serve` started is (when {TRITON_API_KEY_ENV} is unset)")]
    = artifacts.TRITON_KEY,
    repo: Annotated[Path, typer.Option(help="That Triton's model repository")] = artifacts.REPOSITORY_DIR,
    onnx_dir: Annotated[Path, typer.Option(help="Where the default --graph is")] = artifacts.ONNX_DIR,
    drain_s: Annotated[float, typer.Option(
        min=0, help="Seconds between moving traffic off a version and unloading it: longer than the gateways' "
                    "UNROLL_CATALOG_REFRESH_S (2 s), so none still sends to it")] = 5.0,
    samples: Annotated[int, typer.Option(min=1, help="Gate samples from the card's gate data")] = 256,
    as_json: Annotated[bool, typer.Option("--json", help="Print the outcome as JSON")] = False,
) -> None:
    """Load a new version of a served model into the running Triton, gate it, and move traffic to it.

    The new version is staged beside the live one, loaded with no traffic, and checked through Triton on the card's
    gate data (it must answer as its graph does, and not worse than the live version by more than the card's
    tolerance) before any request reaches it; then it takes all traffic (or --canary's share) and the old version
    drains. Any failure before traffic moves rolls back. The gateway picks up versions and the split by itself
    (GET /v1/models lists them).
    """
    from unroll.pipeline import rollout

    if promote and rollback:
        raise fail("--promote and --rollback end a canary in opposite ways: give one")
    if (promote or rollback) and (graph is not None or version is not None or canary is not None):
        raise fail("--promote/--rollback take no --graph, --version or --canary")
    url, found_by = find_triton(triton_url, onnx_dir.parent / artifacts.SERVE_STATE.name)
    first, *mirrors = [u.strip() for u in url.split(",") if u.strip()]
    triton = rollout.TritonControl(first, triton_key(os.environ.get(TRITON_API_KEY_ENV), triton_key_file),
                                   found_by=found_by, mirrors=tuple(mirrors))
    say = (lambda msg: None) if as_json else (lambda msg: typer.echo(f"==> {msg}"))
    if promote:
        out = rollout.promote(name, repo, triton, drain_s, say)
    elif rollback:
        out = rollout.rollback(name, repo, triton, drain_s, say)
    else:
        out = rollout.deploy(name, graph or artifacts.graph(name, onnx_dir=onnx_dir), repo, triton, version, canary,
                             drain_s, samples, say)
    if as_json:
        typer.echo(json.dumps({"model": out.name, "version": out.version, "was": out.live,
                               "traffic": {str(k): v for k, v in out.traffic.items()}, "gate": out.gate,
                               "steps": [{"at_s": t, "step": msg} for t, msg in out.steps],
                               "seconds": round(time.monotonic() - out.started, 3)}, indent=2))
    else:
        split = ", ".join(f"version {v}: {w:g}%" for v, w in out.traffic.items())
        typer.echo(f"{name}: {split}")
