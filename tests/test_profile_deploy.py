"""A user's own model profiled the way they would (issue 57's deployment test).

Not a demo model: a third-party, card-less ONNX (``examples/ista_digits.py`` exported by plain ``torch.onnx.export``)
given its card by ``unroll fuse`` as docs/deploy-your-model.md's third way says, then served by ``unroll serve`` on
non-default ports with two gateway workers and an API key. ``unroll profile`` measures it through the gateway's
``/v1`` route, its ``/v2`` front, and Triton direct over HTTP and gRPC (with the Triton key ``unroll serve`` wrote);
``unroll profile compare`` sets two of the runs side by side.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_deploy_onnx_card import NAME, run_line, way3_commands
from test_deploy_onnx_card import user_dir as user_dir  # noqa: F401  (the fixture: their ONNX and card)
from test_profile import UNROLL, _profile

KEY = "a-users-key"


@pytest.fixture
def served(user_dir: Path):  # noqa: F811
    from unroll.benchmarks.soak import start_serve, stop_serve

    fuse = way3_commands()[0]
    run_line(fuse, user_dir)
    serve = start_serve(user_dir / "build", [NAME], log=lambda m: None, settings={"UNROLL_API_KEY": KEY},
                        args=("--workers", "2"))
    try:
        yield serve, user_dir
    finally:
        stop_serve(serve)


@pytest.mark.triton
@pytest.mark.slow
def test_a_users_own_model_under_unroll_serve_is_profiled_through_every_way_in(served) -> None:
    serve, root = served
    http, grpc, _ = serve.triton_ports
    triton_key = (root / "build" / "triton.key").read_text().strip()
    ways = {"v1": ("--url", serve.base, "--key", KEY, "--target", "v1", "--size", "28"),
            "v2": ("--url", serve.base, "--key", KEY, "--target", "v2"),
            "triton-http": ("--url", f"http://127.0.0.1:{http}", "--key", triton_key, "--target", "triton"),
            "triton-grpc": ("--url", f"grpc://127.0.0.1:{grpc}", "--key", triton_key, "--target", "triton")}
    results = {}
    for way, args in ways.items():
        out = root / f"profile-{way}"
        p = _profile(NAME, *args, "--rate-range", "15", "--arrivals", "poisson", "--duration", "2", "--warmup",
                     "0.5", "--late-tolerance-ms", "50", "--slo", "p99<=2s", "--out", str(out))
        assert p.returncode == 0, (way, p.stderr)
        result = json.loads((out / f"{NAME}-profile.json").read_text())
        (lv,) = result["levels"]
        assert lv["ok"] == lv["sent"] > 10 and not lv["errors"] and lv["slo_met"], (way, lv)
        assert lv["triton"]["requests"] >= lv["sent"], (way, lv["triton"])  # Triton's split, every way in
        procs = lv["service_cpu"]["processes"]  # the whole `unroll serve` tree, found from the port
        assert procs.get("supervisor", 0) >= 1 and procs.get("gateway") == 2 and procs.get("tritonserver", 0) >= 1, \
            (way, procs)
        assert lv["service_cpu"]["total_cpu_ms_per_request"] > 0 and lv["client_cpu_ms_per_request"] > 0
        if way in ("v1", "v2"):
            assert lv["gateway"]["triton_calls"] >= lv["sent"], lv["gateway"]
            assert NAME in {m["name"] for m in result["deployment"]["v1_models"]["models"]}
        results[way] = out / f"{NAME}-profile.json"
    cmp = root / "compare"
    c = subprocess.run([UNROLL, "profile", "compare", str(results["v1"]), str(results["triton-grpc"]), "--out",
                        str(cmp)], capture_output=True, text=True, timeout=120)
    assert c.returncode == 0, c.stderr
    md = (cmp / "profile-compare.md").read_text()
    assert "15 req/s" in md and "v1" in md and "triton" in md, md
    assert (cmp / "profile-compare-latency.png").stat().st_size > 0
