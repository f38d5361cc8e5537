"""`unroll serve --models X` serves exactly X (and the companions its card names), however many other models
`model_repository/` holds from earlier runs: Triton loads only those (explicit model control), the gateway's
`/v1/models` and `/readyz` show only those, and no backend process runs for the others. Real tritonserver and
gateway, on free ports."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from unroll.benchmarks.soak import ServeProcess, start_serve, stop_serve
from unroll.serving.triton import group_members

ASKED = "sdnet-mnist"
#: Its card's λ rule (lam=auto), served with it.
COMPANION = "sdnet-mnist-autolam"
OTHER = "csc-denoiser"


@pytest.fixture(scope="module")
def serve_one(tmp_path_factory: pytest.TempPathFactory, demo_onnx_dir: Path) -> Iterator[ServeProcess]:
    """A repository holding three models (as after an earlier `unroll serve` of all of them), served with
    ``--models sdnet-mnist``."""
    from unroll.serving.repository import write_repository

    root = tmp_path_factory.mktemp("subset")
    shutil.copytree(demo_onnx_dir, root / "onnx")
    write_repository("cpu", [ASKED, COMPANION, OTHER], root / "model_repository", onnx_dir=root / "onnx")
    assert (root / "model_repository" / OTHER / "config.pbtxt").exists()
    serve = start_serve(root, [ASKED], log=lambda m: None)
    try:
        yield serve
    finally:
        stop_serve(serve)
        if serve.proc.stdout is not None:
            serve.proc.stdout.close()


@pytest.mark.triton
@pytest.mark.slow
def test_gateway_lists_only_the_asked_model(serve_one: ServeProcess) -> None:
    with httpx.Client(base_url=serve_one.base, timeout=30) as client:
        models = client.get("/v1/models").json()
        assert [m["name"] for m in models["models"]] == [ASKED], models["models"]
        others = {m["name"]: m for m in models["not_served"]}
        assert others[OTHER]["state"] == "NOT_LOADED" and "not loaded" in others[OTHER]["reason"], others
        ready = client.get("/readyz")
        assert ready.status_code == 200 and set(ready.json()["models"]) == {ASKED, COMPANION}, ready.text
        r = client.post(f"/v1/denoise?model={OTHER}&sigma=25", content=b"x", headers={"Content-Type": "image/png"})
        assert r.status_code in (400, 404), r.text


@pytest.mark.triton
@pytest.mark.slow
def test_triton_loads_only_the_asked_model(serve_one: ServeProcess) -> None:
    """Triton's own (open) readiness API per model, and its Python-backend processes: one per loaded model."""
    http = serve_one.triton_ports[0]
    with httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=10) as client:
        assert client.get(f"/v2/models/{ASKED}/ready").status_code == 200
        assert client.get(f"/v2/models/{COMPANION}/ready").status_code == 200
        assert client.get(f"/v2/models/{OTHER}/ready").status_code != 200
    pid = serve_one.triton_pid()
    assert pid is not None
    stubs = [" ".join(argv) for argv in group_members(pid).values() if "triton_python_backend_stub" in argv[0]]
    assert any(f"/{ASKED}/" in s for s in stubs) and not any(f"/{OTHER}/" in s for s in stubs), stubs


def test_models_triton_was_not_asked_to_load_leave_the_catalog_settled() -> None:
    """A model listed without a state (not loaded: explicit model control) is settled, unlike one still loading:
    the gateway does not rediscover Triton's models on every request because of it."""
    from unroll.serving.gateway.catalog import NOT_LOADED, Entry, Snapshot

    served = Entry(ASKED, "READY")
    by_task = {"classification": (ASKED,), "denoising": ()}
    assert Snapshot({ASKED: served, OTHER: Entry(OTHER, NOT_LOADED, reason="not loaded")}, by_task).complete
    assert not Snapshot({ASKED: served, OTHER: Entry(OTHER, "LOADING", reason="loading")}, by_task).complete
