"""What ``unroll profile`` makes of its results: the plots and ``unroll profile compare``, on two real results.

The inputs are two unedited results of real runs (``tests/fixtures/profile/README.md``). Checked:

- each plot is a PNG with something drawn on it, written only when the run has its data (no open-loop level: no
  latency-against-load plot; no Triton split: no split plot);
- ``unroll profile compare A.json B.json`` (the docs' command, as written) writes a markdown table whose every
  level row holds A's and B's p99 as the files have them, and an overlay plot;
- bad input — a missing file, a folder, a file that is not JSON, one of another schema version, one that is not a
  profile — is one ``error:`` line naming the file, a non-zero exit, and nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from readme_blocks import section

from unroll.benchmarks.profile_compare import fmt
from unroll.benchmarks.profile_plots import write_plots

FIXTURES = Path(__file__).parent / "fixtures" / "profile"
UNROLL = str(Path(sys.executable).parent / "unroll")


def _payload(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _drawn(path: Path) -> None:
    """A real PNG, not a blank canvas: many distinct colours."""
    with Image.open(path) as im:
        assert im.format == "PNG"
        pixels = np.asarray(im.convert("RGB")).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 50, path


def test_each_plot_is_drawn_only_when_the_run_has_its_data(tmp_path: Path) -> None:
    full = _payload("a")
    written = write_plots(full, tmp_path / "full", "a")
    assert sorted(p.name for p in written) == ["a-latency.png", "a-split.png", "a-throughput.png"]
    for p in written:
        _drawn(p)
    closed_only = dict(full, levels=[lv for lv in full["levels"] if lv["mode"] == "closed"])
    for lv in closed_only["levels"]:
        lv.pop("triton", None)
    assert [p.name for p in write_plots(closed_only, tmp_path / "closed", "c")] == ["c-throughput.png"]
    assert write_plots(dict(full, levels=[]), tmp_path / "empty", "e") == []
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir())


def _compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([UNROLL, "profile", "compare", *args], capture_output=True, text=True, timeout=120)


def test_compare_sets_each_level_of_both_files_side_by_side(tmp_path: Path) -> None:
    """The docs' ``unroll profile compare`` command, verbatim, from a folder where its paths lead to the fixtures."""
    [block] = [b for b in section("Plots and comparing two runs") if b.commands]
    [command] = [c.text for c in block.commands]
    assert command.startswith("unroll profile compare ") and "tests/fixtures/profile/a.json" in command, command
    (tmp_path / "tests").symlink_to(FIXTURES.parent.parent)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    out = tmp_path / command.split("--out ", 1)[1].split()[0]
    md = (out / "profile-compare.md").read_text()
    _drawn(out / "profile-compare-latency.png")
    a, b = _payload("a"), _payload("b")
    rows = {cells[0]: cells for line in md.splitlines()
            if line.startswith("| ") and len(cells := [c.strip() for c in line.strip("|").split(" | ")]) == 7}
    for la, lb in zip(a["levels"], b["levels"], strict=True):
        name = (f"{la['offered_rps']:g} req/s ({la['arrivals']} \\| {lb['arrivals']})" if la["mode"] == "open"
                else la["load"])
        assert rows[name][3].startswith(f"{fmt(la['p99_ms'], 'ms')} → {fmt(lb['p99_ms'], 'ms')}"), (name, rows)
    assert len(rows) == 2 + len(a["levels"])  # the header, its rule, one row a level


@pytest.mark.parametrize("case", ["missing", "folder", "not json", "other version", "not a profile"])
def test_bad_input_is_one_line_naming_the_file_and_nothing_written(tmp_path: Path, case: str) -> None:
    bad = tmp_path / "bad.json"
    if case == "folder":
        bad.mkdir()
    elif case == "not json":
        bad.write_text("{ not json")
    elif case == "other version":
        bad.write_text(json.dumps(dict(_payload("a"), schema_version=99)))
    elif case == "not a profile":
        bad.write_text(json.dumps({"levels": []}))
    out = tmp_path / "out"
    p = _compare(str(FIXTURES / "a.json"), str(bad), "--out", str(out))
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert "bad.json" in lines[0] and "Traceback" not in p.stderr + p.stdout
    assert not out.exists()
