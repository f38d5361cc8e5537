"""The README's "## A first request" and the docs site's "## The REST API" examples (docs/rest-api.md), run
verbatim against a live `unroll serve`, so they cannot drift again.

Every ```bash block of those sections is split into commands (``\\`` continuations joined) and each command is run
as written, with bash, from a directory laid out as a fresh clone is after `make serve`: the exports, the
repository and the samples `unroll serve` writes (``build/samples/MODEL.png``), written there by the real
`unroll serve` this test starts on the default models.

Ports: the commands say ``127.0.0.1:8080``; tests never take the default ports (another server, or another test
run, may hold them), so serve runs on free ports and curl is pointed at it by its own config file (``CURL_HOME``,
``connect-to = 127.0.0.1:8080:127.0.0.1:PORT``, ``tests/readme_run.py``). Not one character of a command is
rewritten, and a command naming another port or host fails. The same file makes curl exit non-zero on HTTP ≥ 400
(``fail-with-body``) and print the status on stderr, so each command must exit 0 with HTTP 200; its output is then
checked per endpoint (JSON
shape, the PNG written, headers), and a command this test has no check for fails it. Only curl commands can be
run this way: any other command fails the test, naming it. Blocks that need what this machine lacks live on other
pages, each with the reason it is not run above it (``tests/test_docs.py`` holds every block to that).

The banner `unroll serve` prints must offer the same commands (its sample paths are absolute; its port is the
free one), and the answer the README shows (``# → {...}``) must have the keys of the real one.
"""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from PIL import Image
from readme_blocks import Block, Command, section, split_comment, without_comment
from readme_run import README_BASE, Background, Shell

#: The sections whose curl lines run here: the README's first request and the docs site's REST guide.
SECTIONS = ("A first request", "The REST API")
URL = re.compile(r"https?://[^\s'\"]+")
ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.triton, pytest.mark.slow, pytest.mark.timeout(900)]


def _blocks() -> list[Block]:
    return [b for heading in SECTIONS for b in section(heading)]


@dataclass
class Live:
    """`unroll serve` running as `make serve` runs it, and the directory it runs in (the clone, as a user has it)."""

    serve: Background
    shell: Shell
    models: list[str]

    @property
    def cwd(self) -> Path:
        return self.shell.cwd

    @property
    def base(self) -> str:
        return self.shell.base


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, demo_onnx_dir: Path) -> Iterator[Live]:
    """`unroll serve` as `make serve` runs it (no options but free ports) in a fresh clone of this repository: it
    writes ``model_repository/`` and the samples there; the exports it would make first are copied in (copy2 keeps
    their times, so they are up to date)."""
    from unroll.app.serve import default_models

    root = tmp_path_factory.mktemp("clone")
    subprocess.run(["git", "clone", "-q", str(ROOT), str(root)], check=True, timeout=120)  # a real clone, as users have
    shutil.copytree(demo_onnx_dir, root / "build" / "onnx")
    shell = Shell(root, tmp_path_factory.mktemp("curl"))
    serve = Background.start(shell, f"unroll serve {shell.port_flags()}")
    try:
        yield Live(serve, shell, default_models())
    finally:
        assert serve.stop() == 0, "".join(serve.output)[-3000:]


def run_command(live: Live, command: str) -> subprocess.CompletedProcess:
    """``command`` exactly as the README writes it, run by bash in the clone-like directory."""
    return live.shell.run(command, timeout=120)


# ---------------------------------------------------------------------------------------------- per-endpoint checks


def _json(r: subprocess.CompletedProcess) -> dict:
    return json.loads(r.stdout)


def _label(live: Live, model: str) -> str:
    return (live.cwd / "build" / "samples" / f"{model}.label.txt").read_text().strip()


def _check_classify(live: Live, cmd: Command, query: dict[str, str], r: subprocess.CompletedProcess) -> None:
    body = _json(r)
    model = query.get("model", live.models[0])
    assert body["model"] == model and isinstance(body["latency_ms"], float) and isinstance(body["inverted"], bool)
    preds = body["predictions"]
    assert len(preds) == int(query.get("top_k", 5)) and all(set(p) == {"label", "index", "score"} for p in preds)
    assert preds[0]["label"] == _label(live, model), (body, "the demo classifier misreads its own sample")
    assert all(0 <= p["score"] <= 1 for p in preds) and preds == sorted(preds, key=lambda p: -p["score"])
    if "lam" in query:
        assert math.isfinite(body["lam"]) and body["lam"] > 0, body
    if "iters" in query:
        assert body["iters"] == int(query["iters"]), body
    if "deadline_ms" in query:  # an idle server: the trained count fits, and the controller says it chose it
        assert body["iters_set_by"] == "controller" and body["iters"] == 2, body
    if model == "sdnet-mnist" and "lam" not in query and "iters" not in query:  # its solver residual's verdict
        assert isinstance(body["ood_score"], float) and body["in_distribution"] is True, body
        assert "abstained" not in body, body  # the sample is a digit: nothing withheld, abstain or not
    if cmd.answer is not None:
        _check_answer(live, cmd.answer, body)


def _check_answer(live: Live, answer: str, body: dict) -> None:
    """The answer the README shows has the real one's keys, in order, and its types; its label is the sample's."""
    shown = json.loads(answer.replace(", ...]", "]").replace(", …]", "]"))
    assert list(shown) == list(body), f"README shows keys {list(shown)}, the gateway answers {list(body)}"
    for key, value in shown.items():
        assert type(value) is type(body[key]), (key, value, body[key])
    assert [list(p) for p in shown["predictions"]] == [list(p) for p in body["predictions"][:len(shown["predictions"])]]
    assert shown["predictions"][0]["label"] == _label(live, shown["model"]), "the README's answer is not for its sample"


def _check_denoise(live: Live, cmd: Command, query: dict[str, str], r: subprocess.CompletedProcess) -> None:
    out = re.search(r"-o\s+(\S+)", cmd.text)
    assert out, f"a denoise example that writes no file: {cmd.text}"
    png = live.cwd / out.group(1)
    sample = re.search(r"@(\S+)", cmd.text)
    assert sample
    with Image.open(png) as got, Image.open(live.cwd / sample.group(1)) as sent:
        assert got.format == "PNG" and got.size == sent.size, (got.format, got.size, sent.size)
    if "-D -" in cmd.text:
        headers = r.stdout.decode(errors="replace")
        assert re.search(r"^HTTP/\S+ 200", headers, re.M), headers
        sigma = re.search(r"^x-sigma-used:\s*(\S+)", headers, re.M | re.I)
        assert sigma and math.isfinite(float(sigma.group(1))) and float(sigma.group(1)) > 0, headers


def _check_models(live: Live, cmd: Command, query: dict[str, str], r: subprocess.CompletedProcess) -> None:
    body = _json(r)
    assert sorted(m["name"] for m in body["models"]) == sorted(live.models), body["models"]
    assert all(m["ready"] for m in body["models"])


def _check_healthz(live: Live, cmd: Command, query: dict[str, str], r: subprocess.CompletedProcess) -> None:
    assert _json(r) == {"status": "ok"}


def _check_readyz(live: Live, cmd: Command, query: dict[str, str], r: subprocess.CompletedProcess) -> None:
    body = _json(r)
    assert body["status"] == "ready" and set(live.models) <= set(body["models"]), body


def _check_metrics(live: Live, cmd: Command, query: dict[str, str], r: subprocess.CompletedProcess) -> None:
    text = r.stdout.decode()
    assert 'unroll_gateway_requests_total{' in text and 'route="/v1/classify"' in text, text[:2000]


def _check_openapi(live: Live, cmd: Command, query: dict[str, str], r: subprocess.CompletedProcess) -> None:
    body = _json(r)
    assert body["openapi"].startswith("3.") and {"/v1/classify", "/v1/denoise", "/v1/models"} <= set(body["paths"])


CHECKS: dict[str, Callable[[Live, Command, dict[str, str], subprocess.CompletedProcess], None]] = {
    "/v1/classify": _check_classify, "/v1/denoise": _check_denoise, "/v1/models": _check_models,
    "/healthz": _check_healthz, "/readyz": _check_readyz, "/metrics": _check_metrics, "/openapi.json": _check_openapi,
}


# ---------------------------------------------------------------------------------------------------------- tests


def test_rest_section_has_runnable_examples() -> None:
    blocks = _blocks()
    assert blocks and sum(len(b.commands) for b in blocks) >= 8, blocks
    for b in blocks:
        for cmd in b.commands:
            assert cmd.text.startswith("curl "), (f"only curl commands can be run against the test's server (its "
                                                  f"port is redirected in curl's config): {cmd.text!r}")
            for url in URL.findall(cmd.text):
                assert url.startswith(README_BASE + "/"), f"{url} is not the gateway's default address"
            assert "localhost" not in cmd.text and not re.search(r"\bopen\b|xdg-open", cmd.text), cmd.text


def test_a_fresh_clone_stays_clean_after_serve(live: Live) -> None:
    """What `unroll serve` writes (exports, repository, samples, logs, key) is all ignored by git: the README's first
    command leaves a newcomer's `git status` clean (model_repository/README.md says why nothing there is committed).
    Runs before the README's commands, which write their own output files into the clone."""
    assert (live.cwd / "model_repository" / live.models[0] / "config.pbtxt").is_file()  # serve wrote the repository
    assert (live.cwd / "build" / "samples" / f"{live.models[0]}.png").is_file()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--ignored=no"], cwd=live.cwd,
                            capture_output=True, text=True, check=True, timeout=60).stdout
    assert status == "", f"`unroll serve` left the clone dirty:\n{status}"


def test_rest_section_commands_run_verbatim(live: Live) -> None:
    ran = []
    for block in _blocks():
        for cmd in block.commands:
            url = next(iter(URL.findall(cmd.text)), None)
            assert url is not None, f"no URL in {cmd.text!r}"
            parts = urlsplit(url)
            check = CHECKS.get(parts.path)
            assert check is not None, f"no check for the README command {cmd.text!r}: add one to CHECKS"
            for stale in ("denoised.png",):
                (live.cwd / stale).unlink(missing_ok=True)
            r = run_command(live, cmd.text)
            err = r.stderr.decode(errors="replace")
            out = r.stdout.decode(errors="replace")
            assert r.returncode == 0, f"{cmd.text}\nexit {r.returncode}\n{err}\n{out[:2000]}"
            assert err.strip().splitlines()[-1] == "HTTP 200", f"{cmd.text}\n{err}"
            check(live, cmd, {k: v[-1] for k, v in parse_qs(parts.query).items()}, r)
            ran.append(cmd.text)
    assert len(ran) == sum(len(b.commands) for b in _blocks())


def test_urls_in_rest_comments_answer(live: Live) -> None:
    """URLs the README's comments give for a browser (``/docs``) are served (GET, HTTP 200) too."""
    comments = [*(c for b in _blocks() for c in b.comments),
                *(split_comment(c.text)[1] for b in _blocks() for c in b.commands)]
    urls = sorted({u.rstrip(".,;)") for c in comments for u in URL.findall(c)})
    assert f"{README_BASE}/docs" in urls, comments
    with httpx.Client(timeout=30) as client:
        for url in urls:
            assert url.startswith(README_BASE + "/"), url
            r = client.get(live.base + url[len(README_BASE):])
            assert r.status_code == 200, (url, r.status_code, r.text[:500])


def test_banner_offers_the_readme_commands(live: Live) -> None:
    """Every curl line `unroll serve` prints is one of the README's (sample paths relative to the clone, the
    default port), so the README and the banner say the same."""
    readme = {without_comment(c.text) for b in _blocks() for c in b.commands}
    deadline = time.monotonic() + 10
    while "Ctrl-C stops" not in "".join(live.serve.output) and time.monotonic() < deadline:
        time.sleep(0.1)  # the banner's last line
    banner = [ln.strip() for ln in "".join(live.serve.output).splitlines() if ln.strip().startswith("curl ")]
    assert len(banner) >= 6, live.serve.output
    prefix = f"{live.cwd.resolve()}/"
    for line in banner:
        as_readme = without_comment(line.replace(prefix, "").replace(live.base, README_BASE))
        assert as_readme in readme, f"the banner's\n  {line}\nis not in the README's REST section as\n  {as_readme}"


def test_readme_samples_are_where_serve_writes_them(live: Live) -> None:
    """The sample files the README's commands post are the ones `unroll serve` wrote (build/samples/MODEL.png)."""
    posted = {m for b in _blocks() for c in b.commands for m in re.findall(r"@(\S+)", c.text)}
    assert posted, "the README posts no sample"
    for rel in posted:
        path = live.cwd / rel
        assert path.is_file(), f"{rel}: `unroll serve` wrote {sorted(p.name for p in path.parent.glob('*'))}"
        with Image.open(io.BytesIO(path.read_bytes())) as img:
            assert img.format == "PNG"
