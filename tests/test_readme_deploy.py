"""The README's "## Deploy your own model" commands, run verbatim as a user runs them: each ```bash block (one per
way in) from a fresh directory holding only the user's own files — the README's placeholders made here (way 1: a
checkpoint at ``path/to/checkpoint.pth.tar``, ``classes.txt``, ``cat.png``; way 3: ``their_model.onnx``, a plain
``torch.onnx.export`` of the example by ``python examples/ista_digits.py``, unless the block makes it itself, and
the example card ``examples/my-model.card.json`` where the block names it without its folder), ``examples/`` as in
the clone — with the real `unroll` CLI, a real `unroll serve` (kept running while the commands after it run) and
curl.

The README's ``unroll serve --models NAME`` takes no port options, so it runs on the default ports (8080, 8000–8002):
when one of them is taken here the test skips, naming it (the REST test, ``tests/test_readme_rest.py``, starts its
own server on free ports instead). Every command must exit 0 (curl: HTTP 200; ``tests/readme_run.py``);
classification answers are checked against the labels the user gave. A block this test cannot run is listed in
:data:`WAYS` with the reason and reported as a skip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest
from PIL import Image
from readme_blocks import Block, section
from readme_run import DEFAULT_PORTS, Background, Shell, ports_taken

ROOT = Path(__file__).resolve().parents[1]
SECTION = "Deploy your own model"
#: Each way in: a string that identifies its block, and why it is not run here (``None``: it is run).
WAYS: dict[str, tuple[str, str | None]] = {
    "1-checkpoint": ("--checkpoint path/to/checkpoint.pth.tar", None),
    "2-own-module": ("--model examples/ista_digits.py:ista_digits", None),
    "3-onnx-only": ("unroll fuse their_model.onnx", None),
}
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
URL = re.compile(r"https?://[^\s'\"]+")

pytestmark = [pytest.mark.triton, pytest.mark.slow, pytest.mark.timeout(900)]


def _block(way: str) -> Block:
    marker = WAYS[way][0]
    found = [b for b in section(SECTION) if any(marker in c.text for c in b.commands)]
    assert len(found) == 1, f"README '{SECTION}': {len(found)} bash blocks contain {marker!r} (way {way})"
    return found[0]


def test_every_block_is_a_known_way() -> None:
    blocks = section(SECTION)
    assert len(blocks) == len(WAYS), [c.text for b in blocks for c in b.commands]
    for b in blocks:
        ways = [w for w, (marker, _) in WAYS.items() if any(marker in c.text for c in b.commands)]
        assert len(ways) == 1, f"a block no way (or several) claims: {[c.text for c in b.commands]}"


def _user_files_way1(cwd: Path, block: Block) -> Path:
    """What a user of way 1 has: an official-style checkpoint (``state_dict`` with DataParallel's ``module.``
    prefix) of the architecture, the class names, an image."""
    import torch

    import unroll

    model = unroll.load("sdnet18-cifar", pretrained=False)
    (cwd / "path" / "to").mkdir(parents=True)
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}},
               cwd / "path" / "to" / "checkpoint.pth.tar")
    labels = cwd / "classes.txt"
    labels.write_text("\n".join(CIFAR_CLASSES) + "\n")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(cwd / "cat.png")
    return labels


def _user_files_way2(cwd: Path, block: Block) -> Path:
    """Way 2 runs from the clone: its ``examples/`` folder (the module and its labels)."""
    (cwd / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return cwd / "examples" / "digits.txt"


def _user_files_way3(cwd: Path, block: Block) -> Path:
    """Way 3's user has someone else's ONNX file and a card for it: the example's plain export (made here unless
    the block makes it) and the example card; returns the card's labels, one per line."""
    _user_files_way2(cwd, block)
    text = "\n".join(c.text for c in block.commands)
    if not re.search(r"^python\S* examples/ista_digits\.py", text, re.M):
        r = subprocess.run([sys.executable, "examples/ista_digits.py", "their_model.onnx"], cwd=cwd,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    card = ROOT / "examples" / "my-model.card.json"
    if re.search(r"--card\s+my-model\.card\.json", text):
        shutil.copy(card, cwd / "my-model.card.json")
    labels = cwd.parent / "my-model.labels.txt"
    labels.write_text("\n".join(json.loads(card.read_text())["labels"]) + "\n")
    return labels


def _check_classify(cmd: str, out: bytes, labels: Path) -> None:
    query = {k: v[-1] for k, v in parse_qs(urlsplit(URL.findall(cmd)[0]).query).items()}
    body = json.loads(out)
    names = labels.read_text().split()
    assert body["model"] == query["model"] and len(body["predictions"]) == int(query["top_k"]), body
    assert all(p["label"] == names[p["index"]] for p in body["predictions"]), body


@pytest.mark.parametrize("way", sorted(WAYS))
def test_deploy_your_own_model_commands_run_verbatim(way: str, tmp_path: Path) -> None:
    block = _block(way)
    why_not = WAYS[way][1]
    if why_not is not None:
        pytest.skip(f"README way {way} ({len(block.commands)} commands) not run: {why_not}")
    taken = ports_taken(DEFAULT_PORTS)
    if taken:
        pytest.skip(f"README way {way}'s `unroll serve` line runs on the default ports; taken here: {taken}")
    cwd = tmp_path / "clone"
    cwd.mkdir()
    labels = {"1-checkpoint": _user_files_way1, "2-own-module": _user_files_way2,
              "3-onnx-only": _user_files_way3}[way](cwd, block)
    shell = Shell(cwd, tmp_path / "curl", DEFAULT_PORTS)
    served: Background | None = None
    try:
        for cmd in block.commands:
            if cmd.text.startswith("unroll serve"):
                assert served is None, "two servers in one block"
                served = Background.start(shell, cmd.text)
                model = re.search(r"--models\s+(\S+)", cmd.text)
                assert model and f"model={model.group(1)}" in "".join(served.output), served.output
                continue
            r = shell.run(cmd.text)
            out, err = r.stdout, r.stderr.decode(errors="replace")
            assert r.returncode == 0, f"{cmd.text}\nexit {r.returncode}\n{err[-3000:]}\n{out[-2000:]!r}"
            if cmd.text.startswith("curl "):
                assert served is not None, f"{cmd.text}: no `unroll serve` before it in the block"
                assert err.strip().splitlines()[-1] == "HTTP 200", err
                assert "/v1/classify" in cmd.text, f"no check for {cmd.text!r}: add one"
                _check_classify(cmd.text, out, labels)
            else:
                assert cmd.text.startswith(("unroll ", "python ")), f"no way to run {cmd.text!r} here: add one"
        assert served is not None, "the block serves nothing"
    finally:
        code = served.stop() if served is not None else 0
    assert code == 0, "`unroll serve` did not stop cleanly on Ctrl-C:\n" + "".join(served.output)[-3000:]
