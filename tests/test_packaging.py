"""One import namespace: installing unroll puts nothing but ``unroll`` (and its dist-info) into site-packages."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_install_into_a_fresh_venv_adds_only_unroll(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True)
    (wheel,) = wheels.glob("unroll-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    before = set(p.name for p in site.iterdir())
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    added = {p.name for p in site.iterdir()} - before
    assert {n for n in added if not n.startswith("__pycache__")} == {"unroll", "unroll-0.1.0.dist-info"}
    # the stages are inside the one package, as subpackages, with the committed weights
    for rel in ("export/onnx_export.py", "serving/gateway/app.py", "serving/triton_backend_model.py",
                "app/bench_cli.py", "card.py", "weights/sdnet-mnist.pt"):
        assert (site / "unroll" / rel).is_file(), rel
