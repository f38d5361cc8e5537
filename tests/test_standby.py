"""The warm standby's parts that need no server (``unroll serve --standby``; the soak's phase 5 runs the whole under
load): the gateway's list of Tritons and how its calls move, the ports, how ``unroll deploy`` finds both servers."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from unroll.app.deploy_cli import find_triton
from unroll.app.serve import parse_standby_ports, serve
from unroll.errors import ServeError
from unroll.pipeline.rollout import TritonControl
from unroll.serving.gateway.settings import Settings
from unroll.serving.gateway.triton_client import TritonBackend
from unroll.serving.running import ServeState
from unroll.serving.triton import free_ports


def test_the_gateway_takes_several_tritons_comma_separated_and_refuses_a_scheme_in_any() -> None:
    assert Settings(triton_url=" 127.0.0.1:8001 , 127.0.0.1:8101").triton_url == "127.0.0.1:8001,127.0.0.1:8101"
    for bad in ("127.0.0.1:8001,grpc://127.0.0.1:8101", "127.0.0.1:8001,", ""):
        with pytest.raises(ValueError, match="HOST:PORT"):
            Settings(triton_url=bad)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_call_that_finds_its_triton_down_goes_once_to_the_next_and_stays_there(protocol: str) -> None:
    """Two ports nobody listens on (a real refusal): the probe tries the first, moves to the second, and reports
    not ready; the next call starts from the second."""
    down = free_ports(2)

    async def main() -> tuple[bool, int, str, int]:
        backend = TritonBackend(",".join(f"127.0.0.1:{p}" for p in down), protocol, timeout_s=5)
        try:
            ready = await backend.server_ready(2)
            return ready, backend.failovers, backend.url, backend.unavailable_count
        finally:
            await backend.close()

    ready, failovers, url, unavailable = asyncio.run(main())
    assert not ready and failovers == 1 and url == f"127.0.0.1:{down[1]}" and unavailable == 2


def test_calls_that_fail_together_move_the_gateway_once_not_once_each() -> None:
    async def main() -> None:
        backend = TritonBackend("127.0.0.1:1,127.0.0.1:2", "grpc", timeout_s=5)
        alone = TritonBackend("127.0.0.1:1", "grpc", timeout_s=5)
        try:
            assert backend.fail_over(0) and backend.url == "127.0.0.1:2"
            assert backend.fail_over(0) and backend.url == "127.0.0.1:2"  # a second failure seen on 0: already moved
            assert backend.failovers == 1
            assert not alone.fail_over()  # one Triton: nowhere to go
        finally:
            await backend.close()
            await alone.close()

    asyncio.run(main())


def test_standby_ports_default_to_tritons_plus_100_and_bad_ones_are_named() -> None:
    assert parse_standby_ports(None, (8000, 8001, 8002)) == (8100, 8101, 8102)
    assert parse_standby_ports("9000, 9001,9002", (8000, 8001, 8002)) == (9000, 9001, 9002)
    for bad in ("9000,9001", "9000,9001,x", "9000,9001,٩٠٠٢", "9000,9001,70000"):
        with pytest.raises(ServeError, match="three ports"):
            parse_standby_ports(bad, (8000, 8001, 8002))
    with pytest.raises(ServeError, match="share a port"):
        parse_standby_ports("8001,9001,9002", (8000, 8001, 8002))


def test_a_standby_is_refused_beside_a_triton_of_ones_own(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match="--standby runs a second bundled tritonserver"):
        serve(triton_url="127.0.0.1:8001", standby_ports=(8100, 8101, 8102), onnx_dir=tmp_path / "onnx")


def test_unroll_deploy_finds_both_servers_of_a_service_with_a_standby(tmp_path: Path) -> None:
    state = tmp_path / "serve.json"
    ServeState(os.getpid(), "127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.1:8002", str(tmp_path),
               standby_http="127.0.0.1:8100").write(state)
    url, found_by = find_triton(None, state)
    assert url == "127.0.0.1:8000,127.0.0.1:8100" and str(state) in found_by
    ServeState(os.getpid(), "127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.1:8002", str(tmp_path)).write(state)
    assert find_triton(None, state)[0] == "127.0.0.1:8000"


def test_a_standby_that_does_not_answer_is_skipped_by_a_load() -> None:
    """A standby being restarted loads the folder as it stands when it comes up; a deploy does not wait for it."""
    (port,) = free_ports(1)
    assert not TritonControl(f"127.0.0.1:{port}", timeout_s=2).live()
