"""Model versions in a Triton repository: which versions a model directory serves and how traffic splits.

A model directory holds numeric version directories (``1/``, ``2/`` …) and one ``config.pbtxt``. Which versions
Triton loads is the config's ``version_policy`` (``specific``); how the gateway splits a model's requests between the
loaded versions is the config parameter :data:`TRAFFIC_KEY`, a JSON object ``{"version": weight}``, read by the
gateway's catalog from Triton. Without it the gateway sends everything to the newest loaded version, as Triton's
default policy would. ``unroll deploy`` (:mod:`unroll.pipeline.rollout`) writes both; this module only reads and
writes the files, atomically, and keeps the directory's record (:data:`unroll.artifacts.REPOSITORY_SOURCE_FILE`)
in step so ``unroll serve`` does not mistake a deployed version for a stale directory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from unroll import artifacts
from unroll.errors import RepositoryError

#: Config parameter holding the traffic split between a model's loaded versions (JSON ``{"version": weight}``).
TRAFFIC_KEY = "unroll.traffic"
#: Graph file names a version directory may serve from, by what ``unroll deploy`` can replace.
DEPLOYABLE = "model.onnx"
NOT_DEPLOYABLE = ("model.plan", "model.pt2")


@dataclass(frozen=True)
class ModelDir:
    """One model's directory in a Triton repository."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config_path(self) -> Path:
        return artifacts.model_config(self.path)

    def versions_on_disk(self) -> list[int]:
        """The numeric version directories, oldest first."""
        if not self.path.is_dir():
            raise RepositoryError(f"{self.name}: no model directory {self.path} (write it with `unroll repo`)")
        return sorted(int(p.name) for p in self.path.iterdir() if p.is_dir() and p.name.isdigit())

    def read_config(self) -> tuple[str, mc.ModelConfig]:
        """The config's comment header (kept when it is rewritten) and the parsed config."""
        text = self.config_path.read_text()
        header = "".join(ln + "\n" for ln in text.splitlines() if ln.startswith("#"))
        cfg = mc.ModelConfig()
        try:
            text_format.Parse(text, cfg)
        except text_format.ParseError as e:
            raise RepositoryError(f"{self.name}: config.pbtxt is not a valid Triton model config: {e}") from e
        return header, cfg

    def served(self) -> list[int]:
        """The versions the config's policy loads (``specific``), else the newest on disk (Triton's default)."""
        _, cfg = self.read_config()
        if cfg.version_policy.WhichOneof("policy_choice") == "specific":
            return sorted(cfg.version_policy.specific.versions)
        on_disk = self.versions_on_disk()
        return on_disk[-1:]

    def traffic(self) -> dict[int, float]:
        """The traffic split the config names (empty: all to the newest loaded version)."""
        _, cfg = self.read_config()
        return parse_traffic(cfg.parameters[TRAFFIC_KEY].string_value if TRAFFIC_KEY in cfg.parameters else "",
                             self.name)

    def write_policy(self, versions: list[int], traffic: Mapping[int, float]) -> None:
        """Serve exactly ``versions`` with ``traffic`` (weights of served versions; at least one > 0). One version
        needs no split: the parameter is left out, so a gateway re-reads only Triton's index while nothing changes."""
        check_traffic(versions, traffic, self.name)
        header, cfg = self.read_config()
        cfg.version_policy.Clear()
        cfg.version_policy.specific.versions.extend(sorted(versions))
        if len(versions) > 1:
            cfg.parameters[TRAFFIC_KEY].string_value = json.dumps({str(v): float(w)
                                                                   for v, w in sorted(traffic.items())})
        elif TRAFFIC_KEY in cfg.parameters:  # one version takes everything: no split for the gateway to re-read
            del cfg.parameters[TRAFFIC_KEY]
        _atomic_write(self.config_path, header + text_format.MessageToString(cfg))
        self._record_files()

    def stage(self, version: int, graph: Path) -> Path:
        """Write version directory ``version`` from ``graph``: the newest served version's files with its graph
        replaced (the Python backend's ``model.py`` and any sidecars come along). Returns the directory."""
        if version in self.versions_on_disk():
            raise RepositoryError(f"{self.name}: version {version} already exists in {self.path}; pick another "
                                  "--version or roll it back first")
        source = self.path / str(self.served()[-1])
        blocked = [f for f in NOT_DEPLOYABLE if (source / f).exists()]
        if blocked:
            raise RepositoryError(f"{self.name}: version {source.name} is served from {blocked[0]}, not an ONNX "
                                  "graph; `unroll deploy` replaces ONNX graphs only (rebuild the plan or package and "
                                  "rewrite the repository instead)")
        if not (source / DEPLOYABLE).exists():
            raise RepositoryError(f"{self.name}: version {source.name} has no {DEPLOYABLE} to replace")
        tmp = self.path / f".{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        shutil.copyfile(graph, tmp / DEPLOYABLE)
        dst = self.path / str(version)
        tmp.rename(dst)
        return dst

    def remove(self, version: int) -> None:
        """Delete version directory ``version`` (it must no longer be served)."""
        if version in self.served():
            raise RepositoryError(f"{self.name}: version {version} is still served; take it out of the policy first")
        shutil.rmtree(self.path / str(version), ignore_errors=True)
        self._record_files()

    def _record_files(self) -> None:
        """Re-hash the files the directory's record lists, plus every served version's files, so ``unroll serve``
        sees the directory as written (its inputs, the graph in ``build/onnx``, are unchanged)."""
        path = self.path / artifacts.REPOSITORY_SOURCE_FILE
        record = artifacts.read_json(path)
        if record is None:
            return
        files = {artifacts.TRITON_CONFIG: None}
        for f in record.get("files", {}):
            if not f.split("/", 1)[0].isdigit() and (self.path / f).is_file():
                files[f] = None
        for v in self.served():
            for p in sorted((self.path / str(v)).rglob("*")):
                if p.is_file():
                    files[p.relative_to(self.path).as_posix()] = None
        record["files"] = {f: artifacts.sha256(self.path / f) for f in files}
        _atomic_write(path, json.dumps(record, indent=2) + "\n")


def parse_traffic(raw: str, name: str) -> dict[int, float]:
    """``{"2": 90, "3": 10}`` → ``{2: 90.0, 3: 10.0}``; empty text is no split. Raises on anything else."""
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
        out = {int(k): float(w) for k, w in value.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise RepositoryError(f"{name}: parameter {TRAFFIC_KEY} must be a JSON object of version: weight, "
                              f"not {raw!r}") from e
    if any(w < 0 for w in out.values()) or (out and not any(w > 0 for w in out.values())):
        raise RepositoryError(f"{name}: {TRAFFIC_KEY} weights must be ≥ 0 with one > 0 (got {raw})")
    return out


def check_traffic(versions: list[int], traffic: Mapping[int, float], name: str) -> None:
    """Weights only for served versions, none negative, one positive."""
    extra = sorted(set(traffic) - set(versions))
    if not versions:
        raise RepositoryError(f"{name}: a model must serve at least one version")
    if extra:
        raise RepositoryError(f"{name}: traffic for version(s) {extra} that would not be served ({versions})")
    if any(w < 0 for w in traffic.values()) or not any(w > 0 for w in traffic.values()):
        raise RepositoryError(f"{name}: traffic weights must be ≥ 0 with one > 0 (got {dict(traffic)})")


def _atomic_write(path: Path, text: str) -> None:
    """Triton (or a reader) sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
