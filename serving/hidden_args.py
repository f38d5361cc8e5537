"""Arguments a program takes only on its command line, kept off it: tritonserver's API key.

A command line is readable by every local user (``/proc/PID/cmdline``). :func:`launch` moves the secret arguments
into the environment (``/proc/PID/environ`` is readable by the same user only) and preloads a small shim
(``native/hidden_args.c``) that hands them back to ``main()`` and removes them from what children inherit. The shim
is compiled once per source version into the user's cache with the system C compiler (``CC``, else ``cc``). Where
there is none, :func:`launch` says so in :attr:`Launch.exposed` and the arguments go on the command line as before:
the caller must tell the operator (``unroll serve`` does, with the fix).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("native") / "hidden_args.c"
#: The variable the shim reads its extra arguments from (one per line).
ENV_VAR = "UNROLL_HIDDEN_ARGS"
#: The shim's file name stem; the shim drops any LD_PRELOAD entry containing it from its children's environment.
SHIM_STEM = "unroll_hidden_args"


@dataclass(frozen=True)
class Launch:
    """How to start the program: its command, extra environment, and why the secret is exposed (``None``: it is not)."""

    command: list[str]
    env: dict[str, str]
    exposed: str | None


def cache_dir() -> Path:
    """Where compiled shims live: ``$XDG_CACHE_HOME/unroll/native`` (default ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "unroll" / "native"


def shim() -> tuple[Path | None, str]:
    """The compiled shim (built now if this source version has none yet), or ``None`` and the reason."""
    if not SOURCE.is_file():
        return None, f"the shim's source {SOURCE} is not installed"
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = cache_dir() / f"{SHIM_STEM}-{digest}.so"
    if _trusted(target):
        return target, ""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        return None, "no C compiler (cc) to build the argument shim serving/native/hidden_args.c"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
        os.close(fd)
        run = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"could not build the argument shim in {target.parent}: {e}"
    if run.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        return None, f"{compiler} could not build the argument shim: {run.stderr.strip()[-400:]}"
    os.replace(tmp, target)  # atomic: concurrent starts each build, the last one wins, every reader sees a whole file
    return target, ""


def _trusted(path: Path) -> bool:
    """Whether ``path`` is a shim this user built: a file it owns that nobody else may write (it will run inside
    tritonserver, so a file planted by someone else is rebuilt, never loaded)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return path.is_file() and not path.is_symlink() and st.st_uid == os.getuid() and not st.st_mode & 0o022


def launch(command: list[str], secret_args: list[str], env: dict[str, str]) -> Launch:
    """``command`` + ``secret_args`` run with the secrets off the command line when the shim can be had."""
    if not secret_args:
        return Launch(command, {}, None)
    if any("\n" in arg for arg in secret_args):
        raise ValueError("a hidden argument may not hold a newline (the shim splits on newlines)")
    path, why_not = shim()
    if path is None:
        return Launch([*command, *secret_args], {}, why_not)
    preload = ":".join(filter(None, [str(path), env.get("LD_PRELOAD")]))
    return Launch(command, {"LD_PRELOAD": preload, ENV_VAR: "\n".join(secret_args)}, None)
