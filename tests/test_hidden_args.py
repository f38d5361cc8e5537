"""Secret arguments kept off a command line (:mod:`unroll.serving.hidden_args`), on a real program.

The program is this Python: it prints the argv its ``main()`` got, its own ``/proc/self/cmdline`` and what a child
of it inherits. Without a C compiler the arguments go on the command line and the launch says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unroll.serving import hidden_args

REPORT = ("import json, os, sys, subprocess;"
          "child = subprocess.run(['sh', '-c', 'echo \"$LD_PRELOAD|$UNROLL_HIDDEN_ARGS\"'], capture_output=True, "
          "text=True).stdout.strip();"
          "print(json.dumps({'argv': sys.argv, 'cmdline': open('/proc/self/cmdline').read().split(chr(0))[:-1],"
          " 'child': child}))")


def _run(how: hidden_args.Launch) -> dict:
    out = subprocess.run(how.command, env={**os.environ, **how.env}, capture_output=True, text=True, timeout=60,
                         check=True)
    return json.loads(out.stdout)


def test_the_program_gets_the_arguments_and_its_command_line_and_children_do_not(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # built here, from the source
    python = os.path.realpath(sys.executable)  # the binary itself, not a launcher script
    how = hidden_args.launch([python, "-c", REPORT], ["--key=s3cret-value", "with space"], dict(os.environ))
    assert how.exposed is None and "s3cret-value" not in " ".join(how.command)
    seen = _run(how)
    assert seen["argv"][1:] == ["--key=s3cret-value", "with space"]  # main() got them, in order
    assert not any("s3cret" in a for a in seen["cmdline"]), seen["cmdline"]
    assert seen["child"] == "|"  # neither the shim nor the arguments reach a child
    assert list((tmp_path / "unroll" / "native").glob("unroll_hidden_args-*.so"))


def test_without_a_compiler_the_arguments_go_on_the_command_line_and_the_launch_says_why(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    how = hidden_args.launch([sys.executable, "-c", REPORT], ["--key=s3cret"], {})
    assert how.exposed is not None and "no C compiler" in how.exposed
    assert how.command[-1] == "--key=s3cret" and how.env == {}
    assert "--key=s3cret" in _run(how)["cmdline"]


def test_an_argument_with_a_newline_is_refused() -> None:
    with pytest.raises(ValueError, match="newline"):
        hidden_args.launch(["true"], ["a\nb"], {})


def test_no_secret_arguments_no_shim() -> None:
    assert hidden_args.launch(["true"], [], {}) == hidden_args.Launch(["true"], {}, None)


def test_a_shim_others_could_have_written_is_rebuilt_not_loaded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built, _ = hidden_args.shim()
    assert built is not None
    built.chmod(0o666)  # group/world-writable: anyone could have replaced it
    built.write_bytes(b"not a shared object")
    again, why = hidden_args.shim()
    assert again == built and why == "" and again.stat().st_mode & 0o022 == 0
    assert again.read_bytes().startswith(b"\x7fELF")  # rebuilt from the source
