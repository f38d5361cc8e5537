"""The README's third way in ("Only an ONNX file"), verbatim, on a real card-less ONNX with the example card.

The user's folder holds ``their_model.onnx`` (``examples/ista_digits.py`` exported by plain ``torch.onnx.export``,
as another tool leaves it) and ``my-model.card.json`` (a copy of ``examples/my-model.card.json``); the README's
bash block runs there line by line. A card from a JSON file that lacks a field makes the error name the JSON
field in that file (there is no registration to point at).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import onnx
import pytest
from readme_blocks import page_with
from served_digits import assert_served_like_onnx

from unroll.card import from_onnx

ROOT = Path(__file__).resolve().parents[1]
CARD = ROOT / "examples" / "my-model.card.json"
NAME = "my-model"


def way3_commands() -> list[str]:
    """The shell lines of the docs' bash block under "**3. Only an ONNX file**" (docs/deploy-your-model.md)."""
    text = page_with("**3. Only an ONNX file**").read_text(encoding="utf-8")
    section = text[text.index("**3. Only an ONNX file**"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block in the README's third way in"
    return [ln for ln in block.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def run_line(line: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """One README line through bash, with this venv's ``unroll`` first on PATH (as after ``make venv``)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, f"{line}\n{r.stdout}{r.stderr}"
    return r


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """A user's working folder: their card-less ONNX and the example card under the name the README uses."""
    subprocess.run([sys.executable, str(ROOT / "examples" / "ista_digits.py"), "their_model.onnx"], cwd=tmp_path,
                   check=True, capture_output=True, timeout=300)
    assert not any(p.key == "unroll.card" for p in onnx.load(tmp_path / "their_model.onnx").metadata_props)
    shutil.copy(CARD, tmp_path / "my-model.card.json")
    return tmp_path


def test_readme_way3_fuse_and_quantize_verbatim(user_dir: Path) -> None:
    fuse, quantize, serve = way3_commands()
    assert fuse.startswith("unroll fuse their_model.onnx") and "--card my-model.card.json" in fuse, fuse
    assert quantize.startswith(f"unroll quantize {NAME}") and serve == f"unroll serve --models {NAME}"
    run_line(fuse, user_dir)
    card = from_onnx(user_dir / "build" / "onnx" / f"{NAME}.onnx")
    assert card.model_dump(exclude={"name", "origin", "origin_file"}) == \
        card.model_validate({**json.loads(CARD.read_text()), "name": NAME}).model_dump(
            exclude={"name", "origin", "origin_file"})
    assert (card.name, card.origin, card.origin_file) == (NAME, "file", "my-model.card.json")
    run_line(quantize, user_dir)
    report = json.loads((user_dir / "build" / "onnx" / f"{NAME}.fp16.report.json").read_text())
    assert report["passed"] and (user_dir / "build" / "onnx" / f"{NAME}.fp16.onnx").is_file()


def test_missing_card_field_names_the_json_field(user_dir: Path) -> None:
    """The issue's case: a JSON card without ``data`` → quantize says which JSON field to add, in which file."""
    card = json.loads(CARD.read_text())
    del card["data"]
    (user_dir / "my-model.card.json").write_text(json.dumps(card))
    fuse, quantize, _ = way3_commands()
    run_line(fuse, user_dir)
    r = run_line(quantize, user_dir, check=False)
    message = " ".join(r.stderr.split())  # rich wraps at the terminal width
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert '"data": {"test": ' in message and "in my-model.card.json" in message, message
    assert "registration" not in message, message


@pytest.mark.triton
@pytest.mark.slow
def test_readme_way3_serves_the_model(user_dir: Path) -> None:
    """… and ``unroll serve --models my-model`` (started as ``tests/test_deploy_own.py`` does, on spare ports,
    from the user's build/ folder) classifies like ONNX Runtime runs the graph."""
    from unroll.benchmarks.soak import start_serve, stop_serve

    fuse, quantize, _ = way3_commands()
    run_line(fuse, user_dir)
    run_line(quantize, user_dir)
    graph = user_dir / "build" / "onnx" / f"{NAME}.onnx"
    card = from_onnx(graph)
    serve = start_serve(user_dir / "build", [NAME], log=lambda m: None)  # serves build/onnx, as the README's line
    try:
        assert NAME in {m["name"] for m in httpx.get(f"{serve.base}/v1/models", timeout=30).json()["models"]}
        assert_served_like_onnx(serve.base, NAME, graph, card, count=4)
    finally:
        stop_serve(serve)


def test_field_hints_name_the_field_where_the_card_was_written() -> None:
    """Each origin gets its own spelling: registration (Python attribute), JSON file (the JSON nesting, in that file),
    ``unroll export --model`` options (the option), a dict given to ``export()``."""
    from unroll.export.card_attach import load_card_file
    from unroll.export.user_model import card_from_options

    from_file = load_card_file(CARD, NAME)
    assert from_file.field_hint("data", "test", value="<id>") == '"data": {"test": <id>} in my-model.card.json'
    assert from_file.field_hint("trt_profile", "dims", "1", value=[1, 2, 3]) == \
        '"trt_profile": {"dims": {"1": [1, 2, 3]}} in my-model.card.json'
    registered = from_file.model_copy(update={"origin": "registration", "origin_file": None})
    assert registered.field_hint("data", "test", value="mnist-test") == \
        "card.data.test = 'mnist-test' in the model's registration"
    assert registered.field_hint("trt_profile", "dims", "1", value="<r>") == \
        "card.trt_profile.dims['1'] = <r> in the model's registration"
    options = card_from_options(NAME, "classification", (1, 28, 28))
    assert options.origin == "options" and options.field_hint("data", "test", value="<id>") == \
        "`unroll export ... --data-test <id>`"
    python = from_file.model_copy(update={"origin": "python", "origin_file": None})
    assert "unroll.export.export()" in python.field_hint("data", "train")
