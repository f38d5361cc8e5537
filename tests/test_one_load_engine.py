"""One load engine in the project (issue 57): every benchmark that loads a server sends through
``benchmarks/loadgen.py`` (and its HTTP client, ``loadgen_http.py``); no module keeps a request loop of its own.

The scan reads the source of ``benchmarks/``, ``pipeline/`` and ``app/`` (code only: comments and docstrings that
name the old tools do not count) for the signs of a second loop: a closed-loop driver (``closed_loop(``), ApacheBench
(``"ab"`` run or looked up), a raw socket or ``http.client`` connection, a function that issues requests from threads,
an executor or concurrent tasks, and a loop that times requests against the clock. A file that shows one must be in
:data:`ALLOWED` with the reason it is not a load loop (or why it still is, for now); an entry whose file no longer
shows any sign fails too, so the list only shrinks. Planted samples show the scan can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("benchmarks", "pipeline", "app")
#: The engine itself: the one place a request loop belongs.
ENGINE = {"benchmarks/loadgen.py", "benchmarks/loadgen_http.py"}
#: Files that show a sign, and why each is not a second load loop (or, where one still is, who moves it). Empty:
#: every benchmark that loads a server now sends through the engine.
ALLOWED: dict[str, str] = {}

#: Calls that send a request to a server: HTTP verbs on a client, Triton's infer, urllib.
REQUEST_ATTRS = {"post", "put", "infer", "async_infer", "request", "urlopen", "sendall"}
REQUEST_MODULE_GETS = {"httpx", "requests"}  # ``httpx.get(``: a module-level GET
#: What runs requests side by side: threads, an executor, concurrent asyncio tasks.
CONCURRENT = {"Thread", "ThreadPoolExecutor", "run_in_executor", "gather", "create_task", "TaskGroup", "to_thread"}
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "time"}
#: A connection opened by hand: (module or None, function).
RAW = {("asyncio", "open_connection"), ("socket", "create_connection"), (None, "create_connection"),
       (None, "HTTPConnection"), ("client", "HTTPConnection"), (None, "open_connection")}


def _name(call: ast.Call) -> tuple[str | None, str]:
    f = call.func
    if isinstance(f, ast.Attribute):
        return (f.value.id if isinstance(f.value, ast.Name) else None), f.attr
    return None, f.id if isinstance(f, ast.Name) else ""


def _calls(node: ast.AST) -> list[tuple[str | None, str]]:
    return [_name(n) for n in ast.walk(node) if isinstance(n, ast.Call)]


def _sends(calls: list[tuple[str | None, str]]) -> bool:
    return any(attr in REQUEST_ATTRS or (owner in REQUEST_MODULE_GETS and attr == "get") for owner, attr in calls)


def _ab(node: ast.AST) -> bool:
    """ApacheBench named where a program is run or looked up: ``"ab"`` as a call's argument or in an argv list."""
    if isinstance(node, ast.Call):
        args = [*node.args, *(k.value for k in node.keywords)]
    elif isinstance(node, ast.List | ast.Tuple):
        args = node.elts
    else:
        return False
    return any(isinstance(a, ast.Constant) and a.value == "ab" for a in args)


def signs(source: str) -> list[str]:
    """Every sign of a request loop of its own in ``source`` (a Python module), each as ``line N: what``. The code
    is read as a syntax tree, so comments and docstrings that name the old tools are no sign."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = _name(node)
            if name[1] == "closed_loop":
                found.add((node.lineno, "a closed-loop driver of its own (closed_loop)"))
            if name[1] == "connect" and isinstance(node.func, ast.Attribute):  # a socket's, or http.client's
                found.add((node.lineno, "a connection opened by hand (connect)"))
            if name in RAW or (None, name[1]) in RAW:
                found.add((node.lineno, f"a connection opened by hand ({name[1]})"))
        if _ab(node):
            found.add((node.lineno, 'ApacheBench ("ab") run or looked up'))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name == "closed_loop":
                found.add((node.lineno, "a closed-loop driver of its own (def closed_loop)"))
            calls = _calls(node)
            if _sends(calls) and any(attr in CONCURRENT for _, attr in calls):
                found.add((node.lineno, f"{node.name}() issues requests from threads, an executor or tasks"))
        if isinstance(node, ast.While | ast.For | ast.AsyncFor):
            calls = _calls(node)
            if _sends(calls) and any(attr in CLOCKS for _, attr in calls):
                found.add((node.lineno, "a loop that times requests against the clock"))
    return [f"line {n}: {what}" for n, what in sorted(found)]


def scanned_files() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).glob("*.py"))


def test_no_module_but_the_engine_keeps_a_load_loop_of_its_own() -> None:
    seen = {}
    for path in scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ENGINE:
            continue
        found = signs(path.read_text())
        if found:
            seen[rel] = found
    unexplained = {f: s for f, s in seen.items() if f not in ALLOWED}
    assert not unexplained, ("a second load loop: send through benchmarks/loadgen.py (loadgen.run, run_level, "
                             f"run_processes), or explain it in ALLOWED: {unexplained}")
    stale = sorted(set(ALLOWED) - set(seen))
    assert not stale, f"these no longer show a sign of a loop of their own: drop them from ALLOWED: {stale}"


def test_the_engine_shows_the_signs_it_is_the_home_of() -> None:
    """The scan sees a loop where one is: the engine's HTTP client opens raw connections."""
    assert any("opened by hand" in s for s in signs((ROOT / "benchmarks/loadgen_http.py").read_text()))


PLANTED = {
    "a thread pool posting with httpx": '''
import httpx
from concurrent.futures import ThreadPoolExecutor

def hammer(url, n):
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda _: httpx.post(url, content=b"x"), range(n)))
''',
    "ApacheBench": '''
import shutil, subprocess

def bench(url):
    return subprocess.run([shutil.which("ab"), "-k", "-c", "4", url])
''',
    "a raw socket": '''
import asyncio

async def blast(host, port):
    reader, writer = await asyncio.open_connection(host, port)
''',
    "the old closed loop": '''
from somewhere import closed_loop

def level(make):
    return closed_loop(make, 4, 1.0, 0.1)
''',
    "a closed loop defined anew": '''
import threading

def closed_loop(make, concurrency, duration_s, warmup_s):
    threads = [threading.Thread(target=make()) for _ in range(concurrency)]
''',
    "a timing loop over http.client": '''
import time

def times(conn, body):
    out = []
    stop = time.perf_counter() + 1.0
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        conn.request("POST", "/infer", body)
        conn.getresponse().read()
        out.append(time.perf_counter() - t0)
    return out
''',
    "asyncio tasks posting": '''
import asyncio

async def flood(client, n):
    await asyncio.gather(*(client.post("/v1/classify", content=b"x") for _ in range(n)))
''',
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_a_planted_loop_is_found(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "planted.py"
    path.write_text(PLANTED[kind])
    assert signs(path.read_text()), f"the scan missed {kind}"


def test_the_engine_used_as_meant_and_words_in_docstrings_are_no_sign() -> None:
    source = '''
"""Drives the server with the engine; the old closed_loop( and ab are gone."""
from unroll.benchmarks import loadgen

def level(base, payloads):
    # not ab, not closed_loop(...): the engine
    return loadgen.run(base, payloads, loadgen.Load(concurrency=4), 1.0, 0.2)
'''
    assert signs(source) == []
