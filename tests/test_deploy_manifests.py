"""The cluster manifests in deploy/: the Helm chart renders with Helm's own engine, the manifests validate strictly for
the target Kubernetes version, values changes take effect, and the chart agrees with the code it deploys (probe
paths are the gateway's routes, ports are `unroll serve`'s, the autoscaling target sits above the batcher's delay).

The last test runs the rendered Deployment for real with `podman kube play` (marker ``container``).
"""

from __future__ import annotations

import copy
import http.server
import importlib.util
import inspect
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("render_manifests", ROOT / "scripts" / "render_manifests.py")
rm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rm)

KSERVE = ROOT / "deploy" / "kserve" / "inferenceservice.yaml"
BRIDGE = rm.CHART / "files" / "metrics_bridge.py"
ALL_ON = {"gpu": {"enabled": True}, "autoscaling": {"enabled": True}, "metrics": {"podMonitor": {"enabled": True}}}


def objects(values: dict[str, Any] | None = None, name: str = "unroll") -> dict[str, dict[str, Any]]:
    """Rendered objects by kind (the chart renders at most one of each)."""
    docs = rm.documents(rm.render(values, name=name))
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), [d["kind"] for d in docs]
    return by_kind


def container(objs: dict[str, dict[str, Any]], name: str = "unroll") -> dict[str, Any]:
    return next(c for c in objs["Deployment"]["spec"]["template"]["spec"]["containers"] if c["name"] == name)


# --- renders and validates -------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, ALL_ON, {"replicaCount": 3, "metrics": {"bridge": {"enabled": False}}}],
                         ids=["defaults", "gpu-hpa-podmonitor", "no-bridge"])
def test_chart_renders_and_validates_strict(values: dict[str, Any]) -> None:
    docs = rm.documents(rm.render(values))
    report = rm.validate(docs)
    assert len(report) == len(docs) >= 2
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service"} <= kinds
    if values is ALL_ON:
        assert {"HorizontalPodAutoscaler", "PodMonitor", "ConfigMap"} <= kinds
        assert any(line.startswith("PodMonitor/") and "deploy/schemas/" in line for line in report)


def test_helm_lint_strict() -> None:
    """`helm lint --strict --kube-version` (Helm's own linter): no warning or error, only informational notes."""
    import helm_python as helm

    for values in ({}, ALL_ON):
        report = helm.lint(str(rm.CHART), values, strict=True, kube_version=f"v{rm.KUBE_VERSION}.0")
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("values", [{}, {"shm": {"enabled": False}}, {"metrics": {"bridge": {"enabled": False}}},
                                    {"shm": {"enabled": False}, "metrics": {"bridge": {"enabled": False}}},
                                    {"extraVolumes": [{"name": "trt", "emptyDir": {}}],
                                     "extraVolumeMounts": [{"name": "trt", "mountPath": "/tmp/unroll-trt-cache"}]}])
def test_every_volume_mount_has_its_volume(values: dict[str, Any]) -> None:
    """Schema validation cannot see a mount naming a volume that is not there (the API server rejects the pod)."""
    pod = objects(values)["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"] for v in pod.get("volumes", [])}
    mounts = {m["name"]: m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
    assert set(mounts) <= volumes, (mounts, volumes)
    assert ("dshm" in volumes) == values.get("shm", {}).get("enabled", True)
    if "dshm" in volumes:
        assert mounts["dshm"] == "/dev/shm"
        (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"]["medium"] == "Memory"


def test_kserve_example_validates_against_kserve_schema() -> None:
    (isvc,) = rm.documents(KSERVE.read_text())
    schema = rm.CRD_SCHEMAS[("serving.kserve.io/v1beta1", "InferenceService")]
    assert rm.validate([isvc]) == [f"InferenceService/unroll-triton: ok (deploy/schemas/{schema})"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] == "triton" and model["protocolVersion"] == "v2"
    assert model["storageUri"] and model["runtimeVersion"].endswith("-py3")


def test_kubernetes_validate_cli_strict(tmp_path: Path) -> None:
    """The command a user would run: it passes the core kinds and only *warns* on a custom resource, which is why
    render_manifests.validate checks those against deploy/schemas/ (the test above)."""
    out = tmp_path / "unroll.yaml"
    out.write_text(rm.to_yaml(rm.documents(rm.render(ALL_ON))))
    r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", rm.KUBE_VERSION, str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for kind in ("deployment", "service", "configmap", "horizontalpodautoscaler"):
        assert re.search(rf"passed for resource {kind}/unroll", r.stdout), r.stdout
    assert "WARN" in r.stdout and "PodMonitor" in r.stdout


@pytest.mark.parametrize("breakage", ["container-field-typo", "hpa-field-typo", "probe-port-type",
                                      "podmonitor-typo", "podmonitor-no-selector", "kserve-typo",
                                      "kserve-no-model-format", "kserve-env-without-name"])
def test_validation_fails_on_broken_manifests(breakage: str) -> None:
    """The validators can fail: each mutation is one mistake a hand edit of a template could make."""
    docs = copy.deepcopy(rm.documents(rm.render(ALL_ON))) + rm.documents(KSERVE.read_text())
    k = {d["kind"]: d for d in docs}
    pod = k["Deployment"]["spec"]["template"]["spec"]
    model = k["InferenceService"]["spec"]["predictor"]["model"]
    if breakage == "container-field-typo":
        pod["containers"][0]["readinesProbe"] = pod["containers"][0].pop("readinessProbe")
    elif breakage == "hpa-field-typo":
        k["HorizontalPodAutoscaler"]["spec"]["minReplica"] = 1
    elif breakage == "probe-port-type":
        pod["containers"][0]["livenessProbe"]["httpGet"]["port"] = [8080]
    elif breakage == "podmonitor-typo":
        k["PodMonitor"]["spec"]["podMetricEndpoints"] = k["PodMonitor"]["spec"].pop("podMetricsEndpoints")
    elif breakage == "podmonitor-no-selector":
        del k["PodMonitor"]["spec"]["selector"]
    elif breakage == "kserve-typo":
        model["storageURI"] = model.pop("storageUri")
    elif breakage == "kserve-no-model-format":
        del model["modelFormat"]
    elif breakage == "kserve-env-without-name":
        model["env"] = [{"value": "1"}]
    with pytest.raises(rm.ManifestError, match="do not validate"):
        rm.validate(docs)


def test_chart_fails_on_inconsistent_values() -> None:
    with pytest.raises(rm.ManifestError, match="minReplicas must not exceed"):
        rm.render({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}})
    with pytest.raises(rm.ManifestError, match="metrics.bridge.enabled"):
        rm.render({"autoscaling": {"enabled": True}, "metrics": {"bridge": {"enabled": False}}})


# --- values take effect ---------------------------------------------------------------------------------------


def test_gpu_values() -> None:
    cpu = objects()
    gpu = objects({"gpu": {"enabled": True, "count": 2}})
    cpu_pod, gpu_pod = (o["Deployment"]["spec"]["template"]["spec"] for o in (cpu, gpu))
    assert "nvidia.com/gpu" not in yaml.safe_dump(cpu["Deployment"])
    assert "nodeSelector" not in cpu_pod and "tolerations" not in cpu_pod
    assert container(cpu)["image"].endswith(":cpu")
    main = container(gpu)
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert main["resources"]["limits"]["memory"] == container(cpu)["resources"]["limits"]["memory"]
    assert main["image"].endswith(":gpu")
    assert gpu_pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu_pod["tolerations"]
    # the sidecar gets no GPU and cannot see one through the NGC image's NVIDIA_VISIBLE_DEVICES=all
    bridge = container(gpu, "metrics-bridge")
    assert "nvidia.com/gpu" not in bridge["resources"].get("limits", {})
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in bridge["env"]
    # user node selectors and tolerations are kept beside the GPU ones
    both = objects({"gpu": {"enabled": True}, "nodeSelector": {"pool": "inference"},
                    "tolerations": [{"key": "dedicated", "operator": "Exists"}]})["Deployment"]["spec"]["template"]
    assert both["spec"]["nodeSelector"] == {"pool": "inference", "nvidia.com/gpu.present": "true"}
    assert len(both["spec"]["tolerations"]) == 2


def test_replicas_and_autoscaler() -> None:
    fixed = objects({"replicaCount": 3})
    assert fixed["Deployment"]["spec"]["replicas"] == 3 and "HorizontalPodAutoscaler" not in fixed
    scaled = objects({"replicaCount": 3, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6,
                                                         "targetAverageQueueUs": 50000}})
    assert "replicas" not in scaled["Deployment"]["spec"]  # the HPA owns the count
    hpa = scaled["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": scaled["Deployment"]["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "avg_time_queue_us"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "50000"}


def test_env_and_api_key_secret() -> None:
    c = container(objects({"env": {"UNROLL_MAX_CONCURRENCY": 4}, "apiKeySecret": {"name": "s", "key": "k"}}))
    assert {"name": "UNROLL_MAX_CONCURRENCY", "value": "4"} in c["env"]
    assert {"name": "UNROLL_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}} in c["env"]
    assert "env" not in container(objects())


def test_release_name_changes_every_object_name_and_selector() -> None:
    objs = objects(ALL_ON, name="prod")
    for o in objs.values():
        assert o["metadata"]["name"].startswith("prod-"), o["metadata"]
    dep, svc = objs["Deployment"], objs["Service"]
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert objs["PodMonitor"]["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]


# --- the chart agrees with the code it deploys ----------------------------------------------------------------


def test_ports_match_unroll_serve_defaults() -> None:
    from unroll.app.serve import serve, serve_command

    objs = objects(ALL_ON)
    main = container(objs)
    ((port,),) = [[p["containerPort"] for p in main["ports"] if p["name"] == "http"]]
    for fn in (serve, serve_command):
        assert inspect.signature(fn).parameters["port"].default == port
        assert inspect.signature(fn).parameters["triton_metrics_port"].default == rm.values_from(
            [rm.CHART / "values.yaml"])["metrics"]["tritonPort"]
    bridge = container(objs, "metrics-bridge")
    assert f"--upstream=http://127.0.0.1:{inspect.signature(serve).parameters['triton_metrics_port'].default}/metrics" \
        in bridge["args"]
    # the Service targets the gateway's named port; Triton's ports are not published
    assert objs["Service"]["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    published = {p["containerPort"] for c in objs["Deployment"]["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
    assert published.isdisjoint({8000, 8001, 8002})
    # every port the PodMonitor and the scrape annotations name exists on the pod
    names = {p["name"] for c in objs["Deployment"]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert {e["port"] for e in objs["PodMonitor"]["spec"]["podMetricsEndpoints"]} <= names
    ann = objs["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) in published


def test_probe_paths_are_gateway_routes_outside_the_api_key(tmp_path: Path) -> None:
    """The probes hit real GET routes of the gateway, and answer without the API key (a probe sends none): /healthz
    200 with Triton down, /readyz 503 (not 401), while /v1/* says 401."""
    from unroll.serving.gateway import Settings, create_app
    from unroll.serving.gateway.process import gateway_process
    from unroll.serving.triton import free_ports

    c = container(objects())
    probes = {kind: c[f"{kind}Probe"]["httpGet"] for kind in ("startup", "liveness", "readiness")}
    paths = create_app(Settings()).openapi()["paths"]
    for kind, get in probes.items():
        assert get["port"] == "http"
        assert "get" in paths.get(get["path"], {}), f"{kind} probe path {get['path']} is not a gateway GET route"
    assert probes["readiness"]["path"] == "/readyz" and probes["liveness"]["path"] == "/healthz"

    dead = f"127.0.0.1:{free_ports(1)[0]}"  # no Triton there
    with gateway_process(Settings(triton_url=dead, api_key="secret", ready_timeout_s=0.5), tmp_path / "gw.log",
                         ready_path=probes["startup"]["path"]) as url:
        assert httpx.get(url + probes["liveness"]["path"], timeout=10).status_code == 200
        assert httpx.get(url + probes["readiness"]["path"], timeout=10).status_code == 503
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401


def test_autoscaling_target_above_the_batchers_queue_delay() -> None:
    """Every request waits up to max_queue_delay_microseconds in Triton's queue even on an idle server: a target
    at or below it would scale out at any load. Checked against the default and every committed config."""
    from unroll.serving.repository import DEFAULT_QUEUE_DELAY_US

    target = int(rm.values_from([rm.CHART / "values.yaml"])["autoscaling"]["targetAverageQueueUs"])
    delays = [DEFAULT_QUEUE_DELAY_US] + [
        int(m) for cfg in (ROOT / "model_repository").glob("*/config.pbtxt")
        for m in re.findall(r"max_queue_delay_microseconds:\s*(\d+)", cfg.read_text())]
    assert target >= 10 * max(delays), (target, max(delays))


def test_startup_probe_outlasts_the_images_start() -> None:
    """Kubernetes kills a container whose startup probe keeps failing: the window must cover the longest start the
    image allows itself (the GPU entry point waits UNROLL_TRITON_START_TIMEOUT_S for engine builds; the CPU one is
    `unroll serve`, whose Triton start waits 120 s), or pods restart forever while building engines."""
    from unroll.serving.triton import start

    def window(objs: dict[str, dict[str, Any]]) -> int:
        p = container(objs)["startupProbe"]
        return p["periodSeconds"] * p["failureThreshold"]

    assert window(objects()) >= inspect.signature(start).parameters["timeout_s"].default
    entry = ROOT / "scripts" / "container_gpu_entrypoint.sh"
    if not entry.exists():
        pytest.skip("no GPU entry point in this checkout")
    (gpu_timeout,) = re.findall(r"UNROLL_TRITON_START_TIMEOUT_S:-(\d+)", entry.read_text())
    assert window(objects({"gpu": {"enabled": True}})) > int(gpu_timeout)


def test_configmap_carries_the_bridge_script_verbatim() -> None:
    objs = objects()
    assert objs["ConfigMap"]["data"]["metrics_bridge.py"] == BRIDGE.read_text()
    bridge = container(objs, "metrics-bridge")
    mount = bridge["volumeMounts"][0]["mountPath"]
    assert bridge["command"] == ["python3", f"{mount}/metrics_bridge.py"]


def test_kserve_runtime_matches_the_gpu_image() -> None:
    """The KServe example and the GPU image run the same NGC tritonserver release (a TensorRT plan only loads on
    the TensorRT version it was built with)."""
    dockerfile = ROOT / "Dockerfile"
    if not dockerfile.exists():
        pytest.skip("no Dockerfile in this checkout")
    tags = set(re.findall(r"nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d-py3)", dockerfile.read_text()))
    assert len(tags) == 1, f"the Dockerfile should pin one NGC tritonserver tag, found {sorted(tags)}"
    (isvc,) = rm.documents(KSERVE.read_text())
    assert isvc["spec"]["predictor"]["model"]["runtimeVersion"] == tags.pop()


# --- the metrics bridge (the sidecar's script) ----------------------------------------------------------------


class _FakeTriton(http.server.BaseHTTPRequestHandler):
    BODY = b'# TYPE nv_inference_queue_duration_us counter\nnv_inference_queue_duration_us{model="m"} 42\n'

    def do_GET(self) -> None:  # noqa: N802
        code, body = (200, self.BODY) if self.path == "/metrics" else (404, b"")
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_metrics_bridge_serves_only_metrics(tmp_path: Path) -> None:
    from unroll.serving.triton import free_ports

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeTriton)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port, dead = free_ports(2)
    procs = []
    try:
        for target in (f"http://127.0.0.1:{upstream.server_port}/metrics", f"http://127.0.0.1:{dead}/metrics"):
            procs.append(subprocess.Popen([sys.executable, str(BRIDGE), "--host", "127.0.0.1", "--port",
                                           str(port if not procs else free_ports(1)[0]), "--upstream", target],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        urls = []
        for p in procs:
            line = p.stdout.readline()  # printed once listening
            urls.append(re.search(r"GET (http://\S+)/metrics", line).group(1))
        ok, down = urls
        r = httpx.get(ok + "/metrics", timeout=10)
        assert r.status_code == 200 and r.content == _FakeTriton.BODY
        assert r.headers["content-type"].startswith("text/plain")
        for path in ("/v2/models/x/infer", "/v2/repository/index", "/", "/metricsx"):
            assert httpx.get(ok + path, timeout=10).status_code == 404, path
        assert httpx.post(ok + "/metrics", timeout=10).status_code == 501  # no other method
        assert httpx.get(down + "/metrics", timeout=10).status_code == 503
    finally:
        upstream.shutdown()
        for p in procs:
            p.send_signal(signal.SIGTERM)
    assert [p.wait(timeout=15) for p in procs] == [0, 0]


# --- run for real: podman kube play, one host ------------------------------------------------------------------

READY_DEADLINE_S = 420  # a bound on the wait for both pods, not an assertion on speed


def _cpu_image() -> str:
    """The CPU serving image, built (or reused when its build context is unchanged) by scripts/container_setup.sh
    through tests/container_util.py (H5's helper, shared with tests/test_container.py); skips with the set-up's
    one-line reason where this machine cannot run containers."""
    from container_util import ContainerUnavailable, build_image  # tests/ is on sys.path (no package)

    try:
        return build_image("cpu")
    except ContainerUnavailable as e:
        pytest.skip(f"containers unavailable: {e}")


def _podman(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    from container_util import podman

    return podman(*args, check=check, timeout=timeout)


def _replica_manifests(image: str, replicas: int, tmp: Path) -> list[tuple[Path, list[str], dict[str, int]]]:
    """The chart rendered with ``replicaCount=replicas``, split into one kube-play file per replica.

    `podman kube play` does not do Services, and its pods share the host's port space; so each replica is the
    rendered Deployment under its own name with ``replicas: 1``, every container port published on 127.0.0.1 at a
    spare host port, and its emptyDir volumes renamed per replica (podman 4.3 turns an emptyDir into a *named*
    volume, which two pods would share; Kubernetes gives each pod its own). Those are the only edits: image,
    command, probes, resources, volumes and the sidecar are as rendered. Returns (file, volumes made, ports).
    """
    from unroll.serving.triton import free_ports

    repo, tag = image.rsplit(":", 1)
    # shm.enabled=false: podman 4.3 makes the chart's /dev/shm emptyDir a root-owned volume that the image's
    # non-root user cannot write (Triton's Python backend then fails to load every model); Kubernetes makes
    # emptyDirs world-writable. Without it the pod keeps podman's own /dev/shm (64 MiB tmpfs, writable by all).
    objs = objects({"replicaCount": replicas, "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
                    "shm": {"enabled": False}}, name="kp")
    dep = objs["Deployment"]
    assert dep["spec"]["replicas"] == replicas
    out = []
    for i in range(replicas):
        d = copy.deepcopy(dep)
        d["metadata"]["name"] = f"{dep['metadata']['name']}-r{i}"
        d["spec"]["replicas"] = 1
        pod = d["spec"]["template"]["spec"]
        ports: dict[str, int] = {}
        for c in pod["containers"]:
            for p in c.get("ports", []):
                (host,) = free_ports(1)
                p.update(hostIP="127.0.0.1", hostPort=host)
                ports[p["name"]] = host
        renamed = {v["name"]: f"{v['name']}-{d['metadata']['name']}" for v in pod.get("volumes", [])
                   if "emptyDir" in v}
        for v in pod.get("volumes", []):
            v["name"] = renamed.get(v["name"], v["name"])
        for c in pod["containers"]:
            for m in c.get("volumeMounts", []):
                m["name"] = renamed.get(m["name"], m["name"])
        path = tmp / f"replica-{i}.yaml"
        path.write_text(rm.to_yaml([objs["ConfigMap"], d]))
        out.append((path, [*renamed.values(), objs["ConfigMap"]["metadata"]["name"]], ports))
    return out


def _containers(pod: str) -> list[str]:
    return _podman("ps", "-a", "--filter", f"pod={pod}", "--format", "{{.Names}}", check=False).stdout.split()


def _pod_report(pods: list[str]) -> str:
    """The end of each container's log and its restart count, for a failure message."""
    out = []
    for pod in pods:
        for c in _containers(pod):
            restarts = _podman("inspect", "--format", "{{.RestartCount}}", c, check=False).stdout.strip()
            r = _podman("logs", "--tail", "25", c, check=False)
            out.append(f"--- {c} (restarts: {restarts})\n{(r.stdout + r.stderr)[-2500:]}")
    return "\n".join(out)


def _wait_ready(urls: list[str], pods: list[str]) -> None:
    """Wait until every gateway's /readyz says 200; fail at once (with the logs) when a container keeps
    restarting, and after READY_DEADLINE_S at the latest."""
    import time

    deadline = time.monotonic() + READY_DEADLINE_S
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for u in list(pending):
            try:
                if httpx.get(u + "/readyz", timeout=5).status_code == 200:
                    pending.remove(u)
            except httpx.TransportError:
                pass
        restarts = [int(_podman("inspect", "--format", "{{.RestartCount}}", c, check=False).stdout.strip() or 0)
                    for p in pods for c in _containers(p)]
        if max(restarts, default=0) >= 3:
            raise AssertionError(f"a container keeps restarting (crash loop):\n{_pod_report(pods)}")
        time.sleep(2)
    if pending:
        raise AssertionError(f"not ready within {READY_DEADLINE_S} s: {pending}\n{_pod_report(pods)}")


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_kube_play_two_replicas_survive_one_killed(tmp_path: Path) -> None:
    """`podman kube play` of the chart's rendered Deployment, 2 replicas, from the CPU image.

    ONE HOST, NO KUBERNETES: this shows that the rendered pod spec runs as written (image, entry point, the gateway
    port, resources, security context, the metrics-bridge sidecar and its ConfigMap; the /dev/shm emptyDir is off,
    see _replica_manifests), that each replica is a pod of its own (two Tritons on the same loopback ports, one per
    pod network namespace) and serves on its own, and that killing one leaves the other answering. It proves
    neither multi-node scheduling (one machine, no scheduler), nor Service load balancing (podman has no Services:
    each replica is reached at its own published port), nor autoscaling (no HPA controller, Prometheus or adapter
    here); those need a real cluster.
    """
    from unroll.app.serve import served_cards, write_samples

    image = _cpu_image()
    replicas = _replica_manifests(image, 2, tmp_path)
    staged = ROOT / "build" / "image"  # what the image serves (scripts/container_setup.sh staged it)
    models = (staged / "models.txt").read_text().strip().split(",")
    cards = {c.name: c for c in served_cards(models, staged / "onnx")}
    samples = write_samples(tmp_path / "samples", list(cards.values()))
    digit = next(n for n, c in cards.items() if c.task == "classification" and n in samples)
    label = (tmp_path / "samples" / f"{digit}.label.txt").read_text().strip()

    def classify(url: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/classify", params={"model": digit, "top_k": 1}, timeout=60,
                          files={"image": ("d.png", samples[digit].read_bytes(), "image/png")})

    played: list[Path] = []
    pods: list[str] = []
    try:
        for path, _volumes, _ports in replicas:
            r = _podman("kube", "play", str(path), timeout=300)
            played.append(path)
            pods += re.findall(r"^Pod:\s*\n([0-9a-f]{12,64})", r.stdout, flags=re.M)
        assert len(pods) == 2, pods
        urls = [f"http://127.0.0.1:{ports['http']}" for _p, _n, ports in replicas]
        _wait_ready(urls, pods)

        for url, (_p, _n, ports) in zip(urls, replicas, strict=True):
            r = classify(url)
            assert r.status_code == 200, r.text
            assert r.json()["predictions"][0]["label"] == label
            # Triton's queue-time counters (the HPA's input) reach the pod's address only through the bridge
            m = httpx.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10)
            assert m.status_code == 200
            assert "nv_inference_queue_duration_us" in m.text and "nv_inference_request_success" in m.text
            assert httpx.get(f"http://127.0.0.1:{ports['metrics']}/v2/health/ready", timeout=10).status_code == 404

        # kill replica 0 (SIGKILL to every container of its pod), then replica 1 keeps answering
        _podman("pod", "kill", "--signal", "KILL", pods[0])
        with pytest.raises(httpx.TransportError):
            httpx.get(urls[0] + "/healthz", timeout=5)
        for _ in range(10):
            r = classify(urls[1])
            assert r.status_code == 200, r.text
            assert r.json()["predictions"][0]["label"] == label
        assert httpx.get(urls[1] + "/readyz", timeout=10).status_code == 200
    finally:
        for path in played:
            _podman("kube", "down", str(path), check=False, timeout=120)
        volumes = sorted({v for _p, vols, _ports in replicas for v in vols})
        _podman("volume", "rm", "--force", *volumes, check=False)
