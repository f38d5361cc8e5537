"""Render the Helm chart in deploy/helm/unroll offline and validate the manifests for a target Kubernetes version.

Rendering uses Helm's own engine (the ``helm-python-sdk`` wheel: no ``helm`` binary, cluster or network), so what is
checked is what ``helm template`` produces. Kubernetes' kinds are validated with ``kubernetes-validate --strict``;
the custom resources (KServe ``InferenceService``, ``PodMonitor``) against deploy/schemas/, as strictly.

    python scripts/render_manifests.py -o build/deploy/unroll.yaml --set replicaCount=2
    python scripts/render_manifests.py --validate --set gpu.enabled=true deploy/kserve/inferenceservice.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from unroll.errors import UnrollError

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "unroll"
SCHEMAS = ROOT / "deploy" / "schemas"
#: The Kubernetes version the manifests are validated for (kubernetes-validate's strict schemas of that minor).
KUBE_VERSION = "1.31"
#: Custom resources → their committed JSON Schema.
CRD_SCHEMAS = {
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice-serving.kserve.io-v1beta1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring.coreos.com-v1.json",
}


class ManifestError(UnrollError, ValueError):
    """Rendering failed or a manifest does not validate; the message names the object and the field."""


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Values merged as Helm merges ``-f`` files and ``--set``: maps recursively, anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def values_from(files: Iterable[Path] = (), sets: Iterable[str] = ()) -> dict[str, Any]:
    """Values from YAML files then ``--set a.b=c,d=e`` strings (Helm's own parser), later ones winning."""
    import helm_python as helm

    values: dict[str, Any] = {}
    for f in files:
        values = merge(values, yaml.safe_load(Path(f).read_text()) or {})
    for s in sets:
        values = merge(values, helm.parse_set_string(s))
    return values


def render(values: dict[str, Any] | None = None, name: str = "unroll", namespace: str = "default",
           chart: Path = CHART) -> dict[str, str]:
    """``{template path: rendered YAML}`` as ``helm template NAME CHART -n NAMESPACE`` with ``values`` would give."""
    import helm_python as helm

    try:
        with helm.Chart.load(str(chart)) as c:
            return c.render(values or {}, name=name, namespace=namespace, is_install=True)
    except helm.HelmError as e:
        raise ManifestError(f"helm could not render {chart}: {e}") from None


def documents(rendered: dict[str, str] | str) -> list[dict[str, Any]]:
    """The Kubernetes objects in rendered templates (NOTES.txt and empty documents left out), in a stable order."""
    texts = [rendered] if isinstance(rendered, str) else [
        rendered[k] for k in sorted(rendered) if k.endswith((".yaml", ".yml"))]
    return [d for t in texts for d in yaml.safe_load_all(t) if d]


def to_yaml(docs: list[dict[str, Any]]) -> str:
    return "".join("---\n" + yaml.safe_dump(d, sort_keys=False) for d in docs)


def _kv_dir(strict: bool = True) -> Path:
    from kubernetes_validate import utils

    version = [v for v in utils.all_versions() if utils.major_minor(v) <= KUBE_VERSION][-1]
    base = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    return Path(str(base / f"v{version}-local{'-strict' if strict else ''}"))


def crd_validator(api_version: str, kind: str):
    """A jsonschema validator for a custom resource, Kubernetes types resolved for :data:`KUBE_VERSION`."""
    import jsonschema
    from referencing import Registry, Resource

    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    k8s = json.loads((_kv_dir() / "_definitions.json").read_text())
    registry = Registry().with_resources([(schema["$id"], Resource.from_contents(schema)),
                                          (k8s["$id"], Resource.from_contents(k8s))])
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(docs: Iterable[dict[str, Any]], kube_version: str = KUBE_VERSION) -> list[str]:
    """One line per object: ``Kind/name: ok (how)``; raises :class:`ManifestError` listing every failure."""
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    report, errors = [], []
    for d in docs:
        what = f"{d.get('kind')}/{(d.get('metadata') or {}).get('name')}"
        key = (d.get("apiVersion"), d.get("kind"))
        try:
            if key in CRD_SCHEMAS:
                problems = sorted(crd_validator(*key).iter_errors(d), key=lambda e: list(e.absolute_path))
                if problems:
                    errors += [f"{what}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                               for e in problems]
                    continue
                report.append(f"{what}: ok (deploy/schemas/{CRD_SCHEMAS[key]})")
            else:
                kubernetes_validate.validate(d, kube_version, strict=True)
                report.append(f"{what}: ok (kubernetes-validate --strict, Kubernetes {kube_version})")
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{what}: {'.'.join(map(str, e.path)) or '(top)'}: {e.message}")
        except SchemaNotFoundError as e:
            errors.append(f"{what}: no schema: {e.message}")
        except jsonschema.exceptions.SchemaError as e:
            errors.append(f"{what}: bad schema: {e.message}")
    if errors:
        raise ManifestError("manifests do not validate:\n  " + "\n  ".join(errors))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("extra", nargs="*", type=Path, help="more manifests to validate (e.g. deploy/kserve/*.yaml)")
    p.add_argument("-f", "--values", action="append", type=Path, default=[], help="values file (repeatable)")
    p.add_argument("--set", action="append", default=[], help="Helm --set a.b=c,d=e (repeatable)")
    p.add_argument("--name", default="unroll", help="release name")
    p.add_argument("-n", "--namespace", default="default")
    p.add_argument("-o", "--out", type=Path, help="write the rendered manifests here (one multi-document YAML)")
    p.add_argument("--validate", action="store_true", help="validate instead of printing")
    p.add_argument("--kube-version", default=KUBE_VERSION)
    a = p.parse_args(argv)
    try:
        docs = documents(render(values_from(a.values, a.set), a.name, a.namespace))
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(to_yaml(docs))
            print(f"wrote {a.out} ({len(docs)} objects)", file=sys.stderr)
        if a.validate:
            extra = [d for f in a.extra for d in documents(f.read_text())]
            for line in validate(docs + extra, a.kube_version):
                print(line)
        elif not a.out:
            print(to_yaml(docs), end="")
    except ManifestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
