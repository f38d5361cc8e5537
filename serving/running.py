"""What a running ``unroll serve`` left for the commands that talk to it: its pid, Triton's ports, its repository.

``unroll serve`` writes :data:`unroll.artifacts.SERVE_STATE` (beside the Triton key) once Triton is up and removes
it when it stops; ``unroll deploy`` reads it, so it finds the service's Triton on whatever ports it was started with.
A file left by a killed ``unroll serve`` names a pid that is gone and is ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServeState:
    """A running ``unroll serve``: its process and its Triton's addresses (``HOST:PORT``); with ``--standby``, the
    standby's HTTP address too (``unroll deploy`` loads what it loads into both)."""

    pid: int
    triton_http: str
    triton_grpc: str
    triton_metrics: str
    repository: str
    standby_http: str | None = None

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)

    @property
    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def read_state(path: Path) -> ServeState | None:
    """The state at ``path`` when it names a live ``unroll serve``; ``None`` when there is none (or it is stale)."""
    try:
        state = ServeState(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return state if state.alive else None


def remove_state(path: Path) -> None:
    """Remove ``path`` if it is this process's (a later ``unroll serve`` may have written its own meanwhile)."""
    try:
        mine = json.loads(path.read_text()).get("pid") == os.getpid()
    except (OSError, ValueError, AttributeError):
        return
    if mine:
        path.unlink(missing_ok=True)
