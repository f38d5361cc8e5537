"""Regenerate the JSON Schemas of the two custom resources in deploy/ (KServe InferenceService, PodMonitor).

kubernetes-validate knows only Kubernetes' own kinds; a custom resource it skips with a warning. These fixtures let
tests/test_deploy_manifests.py validate the custom resources offline, as strictly as the core kinds (unknown fields
rejected at every level, required fields enforced). They are generated from packages on the package index, never
written by hand, and committed (no network at test time):

- ``inferenceservice-serving.kserve.io-v1beta1.json``: from the KServe Python SDK's OpenAPI-generated models
  (``kserve/models/v1beta1_*.py``: ``openapi_types``, ``attribute_map``, the ``must not be None`` checks), read
  with :mod:`ast` from the wheel without importing it. Kubernetes types inside (``V1EnvVar``,
  ``V1ResourceRequirements`` ...) are ``$ref``s into kubernetes-validate's ``_definitions.json``, resolved at test
  time against the target Kubernetes version's strict schemas.
- ``podmonitor-monitoring.coreos.com-v1.json``: from cloudcoil's pydantic models of the Prometheus Operator CRDs
  (``model_json_schema``), with ``additionalProperties: false`` added to every object that lists its properties.

Run (any machine that reaches the package index)::

    pip download --no-deps kserve==0.21.0 -d /tmp/w
    python -m venv /tmp/cc && /tmp/cc/bin/pip install cloudcoil-models-prometheus-operator==0.80.1.0
    /tmp/cc/bin/python deploy/schemas/generate.py --kserve-wheel /tmp/w/kserve-0.21.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
K8S_DEFS = "https://kubernetes.io/api/_definitions.json"
#: Where the Kubernetes client's V1Xxx types live in the OpenAPI definitions, most likely first.
K8S_GROUPS = ("io.k8s.api.core.v1.", "io.k8s.apimachinery.pkg.apis.meta.v1.", "io.k8s.api.apps.v1.")
K8S_SPECIAL = {"V1ObjectMeta": "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
               "V1LabelSelector": "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector",
               "V1Time": "io.k8s.apimachinery.pkg.apis.meta.v1.Time",
               "ResourceQuantity": "io.k8s.apimachinery.pkg.api.resource.Quantity",
               "K8sIoApiAppsV1DeploymentStrategy": "io.k8s.api.apps.v1.DeploymentStrategy",
               "K8sIoApiAutoscalingV2HorizontalPodAutoscalerBehavior":
                   "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior"}
#: Types of other projects (Knative status, KEDA triggers) the SDK embeds: accepted unchecked, listed in the output.
FOREIGN_PREFIXES = ("Knative", "GithubCom")
SCALARS = {"str": {"type": "string"}, "int": {"type": "integer"}, "bool": {"type": "boolean"},
           "float": {"type": "number"}, "object": {}, "datetime": {"type": "string"}}


def _dict_literal(tree: ast.Module, cls: str, name: str) -> dict[str, str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                        for t in stmt.targets):
                    return ast.literal_eval(stmt.value)
    raise KeyError(f"{cls}.{name}")


class KServeModels:
    """The SDK's generated model classes, read from the wheel's source."""

    def __init__(self, wheel: Path) -> None:
        self.sources: dict[str, str] = {}
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            self.version = re.fullmatch(r"kserve-(.+)\.dist-info/METADATA", meta).group(1)
            for n in z.namelist():
                if n.startswith("kserve/models/v1beta1_") and n.endswith(".py"):
                    self.sources[n] = z.read(n).decode()
        self.classes: dict[str, tuple[dict[str, str], dict[str, str], list[str]]] = {}
        for text in self.sources.values():
            tree = ast.parse(text)
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name.startswith("V1beta1"):
                    types = _dict_literal(tree, node.name, "openapi_types")
                    names = _dict_literal(tree, node.name, "attribute_map")
                    required = re.findall(r"Invalid value for `(\w+)`, must not be `None`", ast.get_source_segment(
                        text, node) or "")
                    self.classes[node.name] = (types, names, sorted(set(required)))

    def schema(self, root: str) -> dict:
        defs: dict[str, dict] = {}
        unchecked: set[str] = set()

        def ref(t: str) -> dict:
            t = t.strip()
            if t in SCALARS:
                return dict(SCALARS[t])
            m = re.fullmatch(r"list\[(.+)\]", t)
            if m:
                return {"type": "array", "items": ref(m.group(1))}
            m = re.fullmatch(r"dict\(str,\s*(.+)\)", t)
            if m:
                return {"type": "object", "additionalProperties": ref(m.group(1))}
            if t in self.classes:
                if t not in defs:
                    defs[t] = {}
                    types, names, required = self.classes[t]
                    defs[t] = {"type": "object", "additionalProperties": False,
                               "properties": {names[k]: ref(v) for k, v in types.items()}}
                    if required:
                        defs[t]["required"] = [names[k] for k in required]
                return {"$ref": f"#/$defs/{t}"}
            if t in K8S_SPECIAL:
                return {"$ref": f"{K8S_DEFS}#/$defs/{K8S_SPECIAL[t]}"}
            if t.startswith(FOREIGN_PREFIXES):
                unchecked.add(t)
                return {}
            if t.startswith("V1"):  # a Kubernetes client type: its OpenAPI definition, core group first
                return {"$ref": f"{K8S_DEFS}#/$defs/{K8S_GROUPS[0]}{t[2:]}"}
            raise ValueError(f"unknown type {t!r}")

        top = ref(root)
        out = {"$schema": "https://json-schema.org/draft/2020-12/schema",
               "$id": "https://unroll.local/schemas/inferenceservice-serving.kserve.io-v1beta1.json",
               "x-source": f"kserve=={self.version} (PyPI), kserve/models/v1beta1_*.py, by deploy/schemas/generate.py",
               "x-unchecked": sorted(unchecked), **defs[root.strip()], "$defs": defs}
        out["properties"]["apiVersion"] = {"const": "serving.kserve.io/v1beta1"}
        out["properties"]["kind"] = {"const": "InferenceService"}
        assert top == {"$ref": f"#/$defs/{root}"}
        return out


def _strict(schema: object) -> None:
    """additionalProperties: false on every object schema that lists properties; drop pydantic's noise."""
    if not isinstance(schema, dict):
        return
    for k in ("title", "default"):
        schema.pop(k, None)
    if "properties" in schema:
        schema.setdefault("additionalProperties", False)
        for v in schema["properties"].values():
            _strict(v)
    for k in ("items", "additionalProperties", "not"):
        _strict(schema.get(k))
    for k in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for v in schema.get(k, ()):
            _strict(v)
    for v in schema.get("$defs", {}).values():
        _strict(v)


def podmonitor_schema() -> dict:
    from importlib.metadata import version

    from cloudcoil.models.prometheus_operator.v1 import PodMonitor

    s = PodMonitor.model_json_schema(by_alias=True)
    _strict(s)
    pkg = "cloudcoil-models-prometheus-operator"
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://unroll.local/schemas/podmonitor-monitoring.coreos.com-v1.json",
            "x-source": f"{pkg}=={version(pkg)} (PyPI), PodMonitor.model_json_schema(), by deploy/schemas/generate.py",
            **s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kserve-wheel", type=Path, required=True)
    p.add_argument("--out", type=Path, default=HERE)
    a = p.parse_args()
    isvc = KServeModels(a.kserve_wheel).schema("V1beta1InferenceService")
    (a.out / "inferenceservice-serving.kserve.io-v1beta1.json").write_text(json.dumps(isvc, indent=1, sort_keys=True))
    (a.out / "podmonitor-monitoring.coreos.com-v1.json").write_text(
        json.dumps(podmonitor_schema(), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
