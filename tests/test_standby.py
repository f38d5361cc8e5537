"""The warm standby's parts that need no server (on by default where the memory allows it; the soak runs the whole
under load): the gateway's list of Tritons and how its calls move, the ports, how ``unroll deploy`` finds both
servers, and how ``unroll serve`` chooses a standby (its mode, the memory rule, what it says when it runs none)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from unroll.app.deploy_cli import find_triton
from unroll.app.serve import parse_standby_ports, serve, standby_before_start, standby_mode
from unroll.errors import ServeError
from unroll.pipeline.rollout import TritonControl
from unroll.serving import standby as rule
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
        serve(triton_url="127.0.0.1:8001", standby=True, standby_ports=(8100, 8101, 8102), onnx_dir=tmp_path / "onnx")


def test_auto_beside_a_triton_of_ones_own_says_it_runs_no_standby(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The line comes first, before anything is set up (an unknown model then stops the run here)."""
    with pytest.raises(ServeError, match="unknown model"):
        serve(triton_url="127.0.0.1:8001", models=["no-such-model"], onnx_dir=tmp_path / "onnx")
    out = capsys.readouterr().out
    assert "standby: none (auto): --triton-url" in out, out


def test_the_standby_mode_comes_from_unroll_standby_auto_when_unset_and_a_bad_value_is_named() -> None:
    assert standby_mode({}) is None
    assert [standby_mode({"UNROLL_STANDBY": v}) for v in ("auto", "AUTO", "1", "on", "true", "0", "off", "no")] == [
        None, None, True, True, True, False, False, False]
    with pytest.raises(ServeError, match="UNROLL_STANDBY='sometimes': use auto, 1 .on. or 0 .off."):
        standby_mode({"UNROLL_STANDBY": "sometimes"})


def test_auto_runs_a_standby_only_where_twice_the_first_servers_memory_is_available() -> None:
    assert rule.HEADROOM == 2.0
    on = rule.decide(700.0, 1400.0, "MemAvailable")
    off = rule.decide(700.0, 1399.0, "MemAvailable")
    assert on.on and not off.on
    # the line says the figures it went by
    assert "700 MiB resident" in on.why and "1,400 MiB available (MemAvailable)" in on.why, on.why
    assert "1,399 MiB" in off.why and "1,400 MiB" in off.why, off.why


def test_memory_available_is_memavailable_or_a_smaller_cgroup_limit_less_its_use(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemAvailable:    4096000 kB\n")
    limit, current = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text("max\n")
    current.write_text(str(100 * 1024 ** 2) + "\n")
    assert rule.available_mb(meminfo, limit, current) == (4000.0, "MemAvailable")
    limit.write_text(str(1100 * 1024 ** 2) + "\n")  # a container of 1,100 MiB, 100 MiB used
    assert rule.available_mb(meminfo, limit, current) == (1000.0, "the cgroup's memory.max less memory.current")
    assert rule.available_mb(meminfo, tmp_path / "none", tmp_path / "none")[1] == "MemAvailable"
    here, source = rule.available_mb()  # this machine's, as `unroll serve` reads it
    assert here > 0 and source, (here, source)
    meminfo.write_text("MemTotal:       8000000 kB\n")
    with pytest.raises(OSError, match="no MemAvailable"):
        rule.available_mb(meminfo, limit, current)


def test_resident_memory_sums_a_process_group() -> None:
    assert rule.resident_mb(os.getpgrp()) > 0


def test_before_the_first_server_starts_the_standby_is_settled_or_left_to_the_memory_rule() -> None:
    import socket

    free = tuple(free_ports(3))
    assert standby_before_start(None, "cpu", free, ports_given=False) == (None, None)  # auto: decided later
    on, line = standby_before_start(True, "cpu", free, ports_given=False)
    assert on is True and line.startswith("standby: on (--standby"), line
    off, line = standby_before_start(False, "cpu", free, ports_given=False)
    assert off is False and line.startswith("standby: off (--no-standby"), line
    off, line = standby_before_start(None, "gpu", free, ports_given=False)
    assert off is False and "--target gpu" in line and "GPU memory" in line, line
    assert standby_before_start(True, "gpu", free, ports_given=False)[0] is True  # asked for: a copy on the GPU too
    with socket.socket() as held:  # a taken standby port: auto runs without and says why; asked for, it is an error
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = (held.getsockname()[1], free[1], free[2])
        off, line = standby_before_start(None, "cpu", taken, ports_given=False)
        assert off is False and line.startswith("standby: off (auto): standby tritonserver HTTP port") and \
            "is not free" in line, line
        for standby, given in ((True, False), (None, True)):
            with pytest.raises(ServeError, match="is not free.*--standby-ports"):
                standby_before_start(standby, "cpu", taken, ports_given=given)


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
