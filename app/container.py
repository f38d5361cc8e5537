"""The serving images' build context: what the ``Dockerfile`` copies, made on the host before the build.

The images serve graphs exported *before* the build (nothing is exported inside a container: the images have
no PyTorch). :func:`stage` puts into ``build/image/`` (git-ignored):

* ``onnx/`` — the served graphs with their reports (each carries its model card), exported first when missing
  or stale (``unroll serve``'s own rules);
* ``model_repository/`` — the CPU repository (Python backend + ONNX Runtime) the CPU image's ``unroll serve`` runs;
* ``model_repository_gpu/`` — the GPU repository for the NGC Triton image: ``onnxruntime_onnx`` with the
  TensorRT accelerator (engines are built on the target GPU when Triton loads the models; no plan is staged,
  because a plan only loads on the TensorRT version and GPU it was built for);
* ``models.txt`` — the served model names, one line, comma-separated (the entry point's ``--models``).

The CPU repository is written after the graphs are copied, so ``unroll serve`` in the image finds it up to
date and rewrites nothing. :func:`context_digest` hashes what the build would see (the ``.dockerignore``
allow-list), so a test can reuse an image whose inputs have not changed.

``python -m unroll.app.container stage [--models a,b] [--gpu-precision fp16]`` and
``python -m unroll.app.container digest [--target cpu]`` are the command-line forms (``scripts/container_setup.sh``
uses both).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

#: Where :func:`stage` writes the build context's generated part (relative to the repository root).
STAGE_DIR = Path("build/image")
MODELS_FILE = "models.txt"  #: the served model names, comma-separated (the CPU entry point reads it)


@dataclass(frozen=True)
class Staged:
    """What :func:`stage` wrote: the served models (gateway routes) and every Triton model (companions too)."""

    root: Path
    models: tuple[str, ...]
    graphs: tuple[str, ...]


def stage(out: Path = STAGE_DIR, models: list[str] | None = None, onnx_dir: Path = Path("build/onnx"),
          gpu_precision: str = "fp32", gpu: bool = True) -> Staged:
    """Export what is missing, then write ``out/{onnx,model_repository,model_repository_gpu,models.txt}``.

    ``models`` as ``unroll serve --models`` takes them (default: every registered model with committed weights).
    Needs the full install (PyTorch) only when a graph must be exported. ``out`` is rebuilt from scratch.
    """
    from unroll.app.serve import ensure_onnx, graphs_of, resolve_models
    from unroll.serving.repository import write_repository

    onnx_dir = Path(onnx_dir)
    onnx_dir.mkdir(parents=True, exist_ok=True)
    chosen = resolve_models(models, onnx_dir)
    ensure_onnx(onnx_dir, chosen)
    graphs = graphs_of(chosen, onnx_dir)
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    (out / "onnx").mkdir(parents=True)
    for g in graphs:
        for suffix in (".onnx", ".report.json"):
            src = onnx_dir / f"{g}{suffix}"
            if src.exists():
                shutil.copy2(src, out / "onnx" / src.name)
    write_repository("cpu", list(graphs), out / "model_repository", onnx_dir=out / "onnx")
    if gpu:
        # No plan directory: the GPU image runs the ONNX with the TensorRT accelerator, built on its own GPU.
        write_repository("gpu", list(graphs), out / "model_repository_gpu", precision=gpu_precision,
                         onnx_dir=out / "onnx" if gpu_precision == "fp32" else onnx_dir,
                         plan_dir=out / "no-plans")
    (out / MODELS_FILE).write_text(",".join(chosen) + "\n")
    return Staged(out, tuple(chosen), tuple(graphs))


def _allow_list(root: Path) -> tuple[list[str], list[str]]:
    """The ``.dockerignore`` allow-list: paths re-included with ``!`` and patterns excluded after them.

    Only the form this repository's ``.dockerignore`` uses is understood: ``*`` first, then ``!path`` lines
    and exclusion patterns (``**/x``, ``dir/*.ext``).
    """
    lines = [ln.strip() for ln in (root / ".dockerignore").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if not lines or lines[0] != "*":
        raise ValueError(".dockerignore must start with '*' (an allow-list) for context_digest")
    include = [ln[1:].strip("/") for ln in lines[1:] if ln.startswith("!")]
    exclude = [ln for ln in lines[1:] if not ln.startswith("!")]
    return include, exclude


def _excluded(rel: str, patterns: list[str]) -> bool:
    for pat in patterns:
        if pat.startswith("**/"):
            name = pat[3:]
            if any(fnmatch.fnmatch(part, name) for part in rel.split("/")):
                return True
        elif fnmatch.fnmatch(rel, pat) or rel.startswith(pat.rstrip("/") + "/"):
            return True
    return False


def context_files(root: Path = Path(".")) -> list[Path]:
    """Every file the image build can see (relative paths, sorted), by the ``.dockerignore`` allow-list."""
    root = Path(root)
    include, exclude = _allow_list(root)
    files: set[Path] = {Path(".dockerignore")}  # it decides what the build sees, so it is part of the key
    for inc in include:
        p = root / inc
        candidates = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else []
        for q in candidates:
            rel = q.relative_to(root).as_posix()
            if not _excluded(rel, exclude):
                files.add(Path(rel))
    return sorted(files)


def context_digest(root: Path = Path("."), extra: str = "") -> str:
    """sha256 over the build context's file names, modes and contents (and ``extra``: build arguments)."""
    root = Path(root)
    h = hashlib.sha256(extra.encode())
    for rel in context_files(root):
        path = root / rel
        h.update(f"\0{rel.as_posix()}\0{os.stat(path).st_mode & 0o111:o}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m unroll.app.container", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="export what is missing and write build/image/ (the build context's part)")
    s.add_argument("--models", default=None, help="comma-separated, as `unroll serve --models`")
    s.add_argument("--out", type=Path, default=STAGE_DIR)
    s.add_argument("--onnx-dir", type=Path, default=Path("build/onnx"))
    s.add_argument("--gpu-precision", default="fp32", choices=("fp32", "fp16", "int8"))
    s.add_argument("--no-gpu", action="store_true", help="skip the GPU repository")
    d = sub.add_parser("digest", help="print the build context's sha256 (the image cache key)")
    d.add_argument("--extra", default="", help="also hashed: the target and build arguments")
    args = p.parse_args(argv)
    if args.cmd == "stage":
        staged = stage(args.out, args.models.split(",") if args.models else None, args.onnx_dir,
                       args.gpu_precision, gpu=not args.no_gpu)
        print(f"staged {len(staged.graphs)} graph(s) for {', '.join(staged.models)} in {staged.root}")
    else:
        print(context_digest(Path("."), args.extra))


if __name__ == "__main__":
    main()
