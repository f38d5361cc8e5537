"""The serving images' build context: what the ``Dockerfile`` copies, made on the host before the build.

The images have no PyTorch, so graphs are exported before the build. :func:`stage` writes ``build/image/``: the
served graphs with their reports (``onnx/``), the CPU repository (``model_repository/``, written after the graphs so
the image's ``unroll serve`` rebuilds nothing), the GPU repository (``model_repository_gpu/``, no plan: a plan
loads only on the TensorRT version and GPU it was built for) and ``models.txt``. :func:`context_digest` hashes what
the build sees, so a test can reuse an unchanged image. Command line: ``python -m unroll.app.container stage|digest``.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from unroll import artifacts, pipeline
from unroll.app.serve import resolve_models

#: Where :func:`stage` writes the build context's generated part (relative to the repository root).
STAGE_DIR = artifacts.IMAGE_DIR
MODELS_FILE = "models.txt"  #: the served model names, comma-separated (the CPU entry point reads it)


@dataclass(frozen=True)
class Staged:
    """What :func:`stage` wrote: the served models (gateway routes) and every Triton model (companions too)."""

    root: Path
    models: tuple[str, ...]
    graphs: tuple[str, ...]


def stage(out: Path = STAGE_DIR, models: list[str] | None = None, onnx_dir: Path = artifacts.ONNX_DIR,
          gpu_precision: str = "fp32", gpu: bool = True) -> Staged:
    """Export what is missing or stale, then write ``out/{onnx,model_repository,model_repository_gpu,models.txt}``.

    ``models`` as ``unroll serve --models`` takes them (default: every registered model with committed weights).
    Needs the full install (PyTorch) only when a graph must be exported. ``out`` is rebuilt from scratch. Both
    steps are :mod:`unroll.pipeline` plans, the second on the staged copies: the check the image's
    ``unroll serve`` makes, which then finds nothing to rebuild.
    """
    onnx_dir = Path(onnx_dir)
    onnx_dir.mkdir(parents=True, exist_ok=True)
    chosen = resolve_models(models, onnx_dir)
    pipeline.run(pipeline.plan(chosen, onnx_dir=onnx_dir), print)
    graphs = pipeline.graphs_of(chosen, onnx_dir)
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    staged = out / "onnx"
    staged.mkdir(parents=True)
    for g in graphs:
        for src in (artifacts.graph(g, onnx_dir=onnx_dir), artifacts.graph_report(g, onnx_dir=onnx_dir)):
            if src.exists():
                shutil.copy2(src, staged / src.name)
    pipeline.run(pipeline.plan(chosen, onnx_dir=staged, repo=out / artifacts.REPOSITORY_DIR.name), None)
    if gpu:
        # No plan directory: the GPU image runs the ONNX with the TensorRT accelerator, built on its own GPU.
        options = pipeline.RepoOptions(target="gpu", precision=gpu_precision)
        pipeline.run(pipeline.plan(chosen, onnx_dir=staged if gpu_precision == "fp32" else onnx_dir,
                                   repo=out / artifacts.GPU_REPOSITORY_DIR.name, options=options,
                                   plan_dir=out / "no-plans"), None)
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
    lines = [extra] + [f"{rel.as_posix()}\0{os.stat(root / rel).st_mode & 0o111:o}\0{artifacts.sha256(root / rel)}"
                       for rel in context_files(root)]
    return artifacts.sha256_bytes("\n".join(lines).encode())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m unroll.app.container", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="export what is missing and write build/image/ (the build context's part)")
    s.add_argument("--models", default=None, help="comma-separated, as `unroll serve --models`")
    s.add_argument("--out", type=Path, default=STAGE_DIR)
    s.add_argument("--onnx-dir", type=Path, default=artifacts.ONNX_DIR)
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
