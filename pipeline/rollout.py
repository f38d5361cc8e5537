"""``unroll deploy``: a new version of a served model, loaded into the running Triton without a restart.

Against a Triton in explicit model-control mode (``unroll serve`` starts it so, locked with a key it writes to
``build/triton.key``), a deployment

1. stages the new graph as version N beside the live one (:class:`unroll.serving.versions.ModelDir`), checked
   against the served config like any repository (same card, same tensors);
2. loads it with traffic weight 0 (the live version keeps every request; Triton reloads a model's versions without
   dropping a request in flight — its config changed — and the model's warm-up runs before N reports ready);
3. gates it on the card's gate data through Triton before any request reaches it: version N must answer as its graph
   does in ONNX Runtime (the card's FP32 gate: the served version *is* the graph) and must not be worse than the
   live version by more than the card's tolerance on the task's quality metric (accuracy, PSNR);
4. moves traffic: all of it (then, after ``drain_s`` — longer than the gateway's ``catalog_refresh_s`` — the old
   version is unloaded; Triton finishes its in-flight requests first), or a canary share
   (``--canary PCT``; ``--promote`` or ``--rollback`` ends it).

Any failure before traffic moves rolls back: the policy and traffic the model had, version N's files removed, the
model reloaded. The gateway reads versions and the split from Triton (``GET /v1/models``), and its
``unroll_gateway_triton_request_duration_seconds`` histogram is labelled by version.

A service with a warm standby (``unroll serve --standby``) runs two Tritons on one repository: every load goes to
both (:attr:`TritonControl.mirrors`), the gate and the checks to the first. A standby that is restarting at that
moment is skipped: it loads the folder as it then stands when it comes up.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from unroll.card import CARD_KEY, ModelCard, from_onnx
from unroll.errors import DeployError, RepositoryError, ServingError
from unroll.serving.gateway.triton_client import fit_shape, model_info
from unroll.serving.repository_check import validate_model
from unroll.serving.versions import ModelDir

#: Quality metrics compared between the new and the live version (the others measure sameness, not quality).
QUALITY_METRICS = ("accuracy_loss", "psnr_loss_db", "psnr_loss_db_worst")
#: Gate data per deployment check: enough to see a broken version, few enough to keep a rollout quick.
DEFAULT_GATE_SAMPLES = 256
#: Denoisers' gate images are centre-cropped to this (the check is about the weights, not the image size).
GATE_MAX_HW = (96, 96)
#: The advisory lock of a deployment in progress, in the model's directory (Triton ignores dot files).
LOCK_FILE = ".deploy.lock"
#: Card fields that may differ between versions of one served model (provenance, not behaviour).
CARD_PROVENANCE = ("description", "origin", "origin_file")


@dataclass
class TritonControl:
    """The running Triton a deployment talks to (HTTP, its model-control API behind the run's key)."""

    url: str
    key: str | None = None
    timeout_s: float = 120.0
    #: How ``url`` was found (named when Triton cannot be reached).
    found_by: str = "--triton-url"
    #: Other Tritons serving the same repository (a warm standby's HTTP ``HOST:PORT``): every load goes to them too.
    mirrors: tuple[str, ...] = ()
    _client: Any = field(default=None, repr=False)

    @property
    def client(self) -> Any:
        if self._client is None:
            import tritonclient.http as th

            self._client = th.InferenceServerClient(self.url, connection_timeout=self.timeout_s,
                                                    network_timeout=self.timeout_s)
        return self._client

    @property
    def headers(self) -> dict[str, str] | None:
        from unroll.serving.triton import RESTRICTED_HEADER

        return {RESTRICTED_HEADER: self.key} if self.key else None

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` with Triton's refusals and connection failures as :class:`DeployError` naming ``what``."""
        from http.client import HTTPException

        from tritonclient.utils import InferenceServerException

        try:
            return fn()
        except InferenceServerException as e:
            raise DeployError(f"Triton refused {what}: {e.message() or e}") from None
        except HTTPException as e:  # the connection ended without an answer (tritonclient's geventhttpclient)
            raise DeployError(f"Triton at {self.url} closed the connection during {what} without answering "
                              f"({type(e).__name__}: {e}): it ended or restarted meanwhile (`unroll serve`'s "
                              "supervisor restarts it and says why in its output). The restarted Triton serves what "
                              "the model's directory says so far (see GET /v1/models); `unroll deploy` run again "
                              "first brings back a deployment left half-way") from None
        except OSError as e:
            raise DeployError(f"cannot reach Triton at {self.url} (from {self.found_by}) for {what} "
                              f"({type(e).__name__}: {e}); is `unroll serve` running from this folder, or is "
                              "--triton-url its Triton's HTTP port?") from None

    def load(self, name: str) -> None:
        """(Re)load ``name`` as its directory now says, here and in each mirror that is up; raises
        :class:`DeployError` with Triton's reason."""
        self.call(f"loading {name}", lambda: self.client.load_model(name, headers=self.headers))
        for url in self.mirrors:
            mirror = TritonControl(url, self.key, self.timeout_s, f"{self.found_by}, standby")
            if mirror.live():
                mirror.load(name)

    def live(self) -> bool:
        """Whether this Triton answers at all (a standby being restarted does not)."""
        try:
            return bool(self.client.is_server_live(headers=self.headers))
        except Exception:  # noqa: BLE001 - refused, reset, a half-started server: not live, whatever the error
            return False

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index: one row per model version (``name``, ``version``, ``state``)."""
        return self.call("its repository index", lambda: self.client.get_model_repository_index(headers=self.headers))

    def ready_versions(self, name: str) -> list[int]:
        index = self.index()
        return sorted(int(m["version"]) for m in index
                      if m.get("name") == name and m.get("state") == "READY" and str(m.get("version", "")).isdigit())

    def wait_unloaded(self, name: str, versions: list[int], timeout_s: float = 60.0) -> None:
        """Until Triton lists none of ``versions`` as loaded or unloading (their in-flight requests are done)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = [m["version"] for m in self.index() if m.get("name") == name and str(m.get("version")) in
                    {str(v) for v in versions} and m.get("state") in ("READY", "UNLOADING")]
            if not left:
                return
            if time.monotonic() > deadline:
                raise DeployError(f"{name}: version(s) {', '.join(left)} still unloading after {timeout_s:g} s")
            time.sleep(0.1)

    def config(self, name: str) -> dict[str, Any]:
        return self.call(f"the config of {name}", lambda: self.client.get_model_config(name, headers=self.headers))

    def runner(self, name: str, version: int) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
        """A gate ``Run``: feeds → the model's first output, through Triton on ``version``."""
        import tritonclient.http as th
        from tritonclient.utils import np_to_triton_dtype

        meta = self.call(f"the metadata of {name} version {version}",
                         lambda: self.client.get_model_metadata(name, str(version), headers=self.headers))
        info = model_info(name, meta, self.config(name))
        output = self.card(name).output

        def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
            inputs = []
            for n, a in feeds.items():
                if n not in info.inputs:
                    raise DeployError(f"{name} version {version} has no input {n!r} (inputs: {list(info.inputs)})")
                a = fit_shape(np.ascontiguousarray(a), info.inputs[n])  # a [B] tensor Triton takes as [B, 1]
                i = th.InferInput(n, list(a.shape), np_to_triton_dtype(a.dtype))
                i.set_data_from_numpy(a, binary_data=True)
                inputs.append(i)
            res = self.call(f"an inference on {name} version {version}", lambda: self.client.infer(
                name, inputs, model_version=str(version), headers=self.headers,
                outputs=[th.InferRequestedOutput(output, binary_data=True)]))
            return res.as_numpy(output)

        return run

    def card(self, name: str) -> ModelCard:
        raw = ((self.config(name).get("parameters") or {}).get(CARD_KEY) or {}).get("string_value")
        if not raw:
            raise DeployError(f"{name}: Triton's config has no model card; write the repository with `unroll repo`")
        return ModelCard.from_json(raw, f"Triton config of {name}")


@dataclass
class Outcome:
    """What a deployment did, for the command's output and its tests."""

    name: str
    version: int
    live: list[int]
    traffic: dict[int, float]
    gate: dict[str, Any] = field(default_factory=dict)
    #: Each step's message and when it started, in seconds since the command began.
    steps: list[tuple[float, str]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


def deploy(name: str, graph: Path, repo: Path, triton: TritonControl, version: int | None = None,
           canary: float | None = None, drain_s: float = 5.0, samples: int = DEFAULT_GATE_SAMPLES,
           say: Callable[[str], None] = print) -> Outcome:
    """Load ``graph`` as a new version of the served model ``name`` and move traffic to it (module docstring).

    ``canary``: the share (0–100, exclusive) the new version gets; the rest stays on the live version until
    :func:`promote` or :func:`rollback`. Raises :class:`DeployError` after rolling back on any failure."""
    if canary is not None and not 0 < canary < 100:
        raise DeployError(f"--canary is a percentage of traffic between 0 and 100 (exclusive), not {canary:g}")
    md = ModelDir(Path(repo) / name)
    with _exclusive(md, triton, say):
        return _deploy(md, graph, triton, version, canary, drain_s, samples, say)


def _deploy(md: ModelDir, graph: Path, triton: TritonControl, version: int | None, canary: float | None,
            drain_s: float, samples: int, say: Callable[[str], None]) -> Outcome:
    name, repo = md.name, md.path.parent
    live = md.served()
    if len(live) > 1:
        raise DeployError(f"{name}: a canary is in progress (versions {', '.join(map(str, live))}); end it with "
                          f"`unroll deploy {name} --promote` or `--rollback` first")
    serving = triton.ready_versions(name)
    if serving != live:
        raise DeployError(f"{name}: Triton serves version(s) {serving or 'none'}, its directory "
                          f"in {repo} says {live}: is --repo the repository of the Triton at {triton.url}?")
    served_card = triton.card(name)
    _check_card(name, served_card, graph)
    new = version if version is not None else max(md.versions_on_disk()) + 1
    before = md.traffic()
    out = Outcome(name, new, live, {})
    step = _stepper(out, say)
    step(f"stage {graph} as {name} version {new} (beside live version {live[-1]})")
    try:
        md.stage(new, graph)
        validate_model(md.path, reference_onnx=graph, name=name)
    except RepositoryError as e:
        _remove(md, new)
        raise DeployError(f"{name} version {new}: {e}") from None
    try:
        md.write_policy(live + [new], {v: 100.0 for v in live} | {new: 0.0})
        step(f"load version {new} with no traffic (warm-up runs before it reports ready)")
        triton.load(name)
        if new not in triton.ready_versions(name):
            raise DeployError(f"{name} version {new} did not become ready (Triton's log says why)")
        step(f"gate version {new} on the card's {served_card.data.gate} data through Triton")
        out.gate = check(name, graph, served_card, triton, live[-1], new, samples)
        if out.gate["failures"]:
            raise DeployError(f"{name} version {new} failed its gate: " + "; ".join(out.gate["failures"]))
    except (ServingError, RepositoryError, OSError, ValueError) as e:
        step(f"roll back: version {new} removed, {name} serves version {live[-1]} as before")
        _restore(md, triton, live, before, new)
        raise DeployError(str(e)) from None
    if canary is not None:
        out.traffic = {live[-1]: 100.0 - canary, new: canary}
        md.write_policy(live + [new], out.traffic)
        triton.load(name)
        step(f"canary: version {new} takes {canary:g}% of {name}'s requests (end it with --promote or --rollback)")
        return out
    _move_all(md, triton, name, keep=new, drop=live, drain_s=drain_s, step=step)
    out.traffic = {new: 100.0}
    return out


def promote(name: str, repo: Path, triton: TritonControl, drain_s: float = 5.0,
            say: Callable[[str], None] = print) -> Outcome:
    """End a canary: its newest version takes all traffic; the older one drains and is unloaded."""
    md = ModelDir(Path(repo) / name)
    with _exclusive(md, triton, say):
        live = md.served()
        if len(live) < 2:
            raise DeployError(f"{name}: no canary to promote (it serves version {live[-1]} alone)")
        out = Outcome(name, live[-1], live, {live[-1]: 100.0})
        _move_all(md, triton, name, keep=live[-1], drop=live[:-1], drain_s=drain_s, step=_stepper(out, say))
        return out


def rollback(name: str, repo: Path, triton: TritonControl, drain_s: float = 5.0,
             say: Callable[[str], None] = print) -> Outcome:
    """End a canary the other way: the older version takes all traffic back; the canary drains, is unloaded and its
    files are removed."""
    md = ModelDir(Path(repo) / name)
    with _exclusive(md, triton, say):
        live = md.served()
        if len(live) < 2:
            raise DeployError(f"{name}: no canary to roll back (it serves version {live[-1]} alone)")
        out = Outcome(name, live[0], live, {live[0]: 100.0})
        step = _stepper(out, say)
        _move_all(md, triton, name, keep=live[0], drop=live[1:], drain_s=drain_s, step=step)
        for v in live[1:]:
            md.remove(v)
        step(f"removed version(s) {', '.join(map(str, live[1:]))}")
        return out


def check(name: str, graph: Path, card: ModelCard, triton: TritonControl, live: int, new: int,
          samples: int = DEFAULT_GATE_SAMPLES) -> dict[str, Any]:
    """The deployment gate (module docstring, step 3): the metrics of both comparisons and the failures."""
    from unroll import gates

    max_batch = int(triton.config(name).get("max_batch_size", 0)) or 1
    cases = _first(gates.gate_cases(card, split=card.data.gate, max_batch=max_batch, max_hw=GATE_MAX_HW), samples)
    graph_run = gates.onnxruntime_run(graph, card.output, threads=1)
    candidate = triton.runner(name, new)
    tol = gates.tolerances(card, "fp32")
    parity = gates.evaluate(card, cases, graph_run, candidate, tol)
    quality_tol = {k: v for k, v in tol.items() if k in QUALITY_METRICS}
    quality = gates.evaluate(card, cases, triton.runner(name, live), candidate, quality_tol) if quality_tol else None
    failures = [f"served vs its graph: {f}" for f in parity.failures]
    if quality is not None:
        failures += [f"vs live version {live}: {f}" for f in quality.failures]
    return {"samples": sum(len(c) for c in cases), "source": gates.gate_source(card, cases, card.data.gate),
            "parity": _plain(parity.metrics), "vs_live": _plain(quality.metrics) if quality else None,
            "tolerances": tol, "failures": failures}


def _move_all(md: ModelDir, triton: TritonControl, name: str, keep: int, drop: list[int], drain_s: float,
              step: Callable[[str], None]) -> None:
    """All traffic to ``keep``; after ``drain_s`` (gateways re-read the split meanwhile), ``drop`` unloaded."""
    both = sorted({keep, *drop})
    md.write_policy(both, {v: (100.0 if v == keep else 0.0) for v in both})
    triton.load(name)
    step(f"traffic: all of {name}'s requests to version {keep}; waiting {drain_s:g} s for the gateways to follow")
    time.sleep(drain_s)
    md.write_policy([keep], {keep: 100.0})
    triton.load(name)  # Triton finishes the dropped versions' in-flight requests before it unloads them
    triton.wait_unloaded(name, drop)
    step(f"unloaded version(s) {', '.join(map(str, drop))}; {name} serves version {keep}")


@contextmanager
def _exclusive(md: ModelDir, triton: TritonControl, say: Callable[[str], None]) -> Iterator[None]:
    """One deployment of a model at a time (an advisory lock in its directory, released by the kernel however the
    holder ends; another is refused at once), starting from a consistent model (:func:`_finish_interrupted`)."""
    if not md.path.is_dir():
        raise DeployError(f"{md.name}: no model directory {md.path} (is --repo the served repository?)")
    lock = md.path / LOCK_FILE
    with open(lock, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DeployError(f"{md.name}: another `unroll deploy` of it is running; wait for it to finish") \
                from None
        try:
            _finish_interrupted(md, triton, say)
            yield
        finally:
            lock.unlink(missing_ok=True)  # still ours: a second deploy is refused while we hold it, never waits


def _finish_interrupted(md: ModelDir, triton: TritonControl, say: Callable[[str], None]) -> None:
    """Bring back a model an earlier deployment left half-way (killed, or its machine restarted).

    Only a deployment in progress gives a version weight 0 beside one with all the traffic: a version staged and
    not yet gated, or one being drained. Either way that version goes (unloaded, and its files removed when it is
    newer than the one kept: it never took traffic for good); version directories newer than every served version
    and not in the policy are a staging that never reached the policy."""
    live, traffic = md.served(), md.traffic()
    idle = [v for v in live if traffic and traffic.get(v, 0.0) == 0.0]
    keep = [v for v in live if v not in idle]
    if idle and keep:
        say(f"an earlier deployment of {md.name} did not finish (version(s) {', '.join(map(str, idle))} had no "
            f"traffic): {md.name} serves version(s) {', '.join(map(str, keep))} again")
        md.write_policy(keep, {v: traffic[v] for v in keep} if len(keep) > 1 else {keep[0]: 100.0})
        triton.load(md.name)
        triton.wait_unloaded(md.name, idle)
        for v in idle:
            if v > max(keep):
                md.remove(v)
    newest = max(md.served())
    for v in md.versions_on_disk():
        if v > newest:
            say(f"{md.name}: removed version {v}'s files, staged by a deployment that did not finish")
            _remove(md, v)
    serving = triton.ready_versions(md.name)
    if serving and serving != md.served():  # e.g. a Triton restarted with a policy written since: follow the folder
        say(f"{md.name}: Triton serves version(s) {serving}, its directory says {md.served()}: reloading it")
        triton.load(md.name)  # (if --repo is not that Triton's repository, the deployment is refused next)


def _restore(md: ModelDir, triton: TritonControl, live: list[int], before: dict[int, float], new: int) -> None:
    """The model as it was: its policy and traffic, version ``new`` gone, reloaded."""
    md.write_policy(live, before or {v: 100.0 for v in live})
    try:
        triton.load(name := md.name)
    finally:
        _remove(md, new)
    serving = triton.ready_versions(name)
    if serving != live:
        raise DeployError(f"{name}: rolled back, but Triton now serves {serving}, not {live}")


def _remove(md: ModelDir, version: int) -> None:
    """Version ``version``'s files, staged or half-staged, gone (it was never served)."""
    shutil.rmtree(md.path / str(version), ignore_errors=True)
    shutil.rmtree(md.path / f".{version}.tmp", ignore_errors=True)


def _check_card(name: str, served: ModelCard, graph: Path) -> None:
    """The new graph must carry the served model's card (its inputs, outputs, labels, knobs): a version is new
    weights, not a new interface. Provenance fields may differ."""
    if not Path(graph).is_file():
        raise DeployError(f"{name}: no graph at {graph} (export it with `unroll export`)")
    new = from_onnx(graph)
    a, b = served.model_dump(mode="json"), new.model_dump(mode="json")
    differ = sorted(k for k in a.keys() | b.keys() if k not in CARD_PROVENANCE and a.get(k) != b.get(k))
    if differ:
        raise DeployError(f"{name}: {graph}'s card differs from the served model's in {', '.join(differ)}; a new "
                          "version must keep the model's interface (serve a new model under another name instead)")


def _first(cases: list, samples: int) -> list:
    """Cases until ``samples`` samples are covered (whole cases)."""
    out, n = [], 0
    for c in cases:
        if n >= samples:
            break
        out.append(c)
        n += len(c)
    return out


def _plain(metrics: dict) -> dict:
    return json.loads(json.dumps(metrics, default=float))


def _stepper(out: Outcome, say: Callable[[str], None]) -> Callable[[str], None]:
    def step(msg: str) -> None:
        out.steps.append((round(time.monotonic() - out.started, 3), msg))
        say(msg)

    return step
