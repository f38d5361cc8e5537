"""What the gateway serves, discovered from Triton: each model's card from its config, never from its name.

``unroll repo`` copies each card into its Triton config; the catalog reads the repository index, each loaded
model's config and metadata, and serves a model on its task's route when its card's tensors exist in Triton;
everything else is listed with the reason. Discovery is lazy and cached (the gateway may start before Triton) and
rebuilt when a request names an unknown model, after Triton was unavailable, or while models load, at most once per
:data:`MIN_REFRESH_S`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

from unroll import tasks
from unroll.card import CARD_KEY, CardError, ModelCard
from unroll.errors import TritonError, UnrollError
from unroll.serving.gateway.errors import ApiError
from unroll.serving.gateway.settings import ENV_PREFIX, Settings
from unroll.serving.gateway.triton_client import ModelInfo, TritonBackend, model_info
from unroll.serving.versions import TRAFFIC_KEY, parse_traffic

log = logging.getLogger("unroll.gateway")

#: Least time between two discoveries triggered by requests.
MIN_REFRESH_S = 1.0
#: State of a model Triton lists without a state: in its repository but not asked to load (explicit model control,
#: ``unroll serve --models`` loads only the named models). Settled, unlike ``LOADING``: no reason to look again.
NOT_LOADED = "NOT_LOADED"
#: Version states worth listing: loaded, or on the way in or out (Triton keeps unloaded versions in its index).
LIVE_STATES = ("READY", "LOADING", "UNLOADING")
#: State of a loaded model whose metadata or config Triton did not give (a timeout, a restart): not known to serve
#: or not; a request for it (or for its task, when nothing else serves it) gets 503 and the catalog looks again.
UNREAD = "UNREAD"


@dataclass(frozen=True)
class Version:
    """One version of a model as Triton lists it, with its share of the model's traffic."""

    version: str
    state: str
    #: Relative weight from the config's traffic split (:data:`unroll.serving.versions.TRAFFIC_KEY`); ``None``
    #: when the config has none (then the newest ready version takes everything).
    weight: float | None = None

    def public(self) -> dict[str, str | float | None]:
        return {"version": self.version, "state": self.state, "traffic": self.weight}


@dataclass(frozen=True)
class Entry:
    """One model in Triton's repository, as the gateway sees it."""

    name: str
    #: Triton's state (``READY`` when a version is loaded).
    state: str
    card: ModelCard | None = None
    info: ModelInfo | None = None
    #: Why ``/v1`` does not serve it; ``None`` when it is served.
    reason: str | None = None
    #: The versions Triton lists for it, oldest first.
    versions: tuple[Version, ...] = ()

    def pick_version(self, exclude: str | None = None) -> str:
        """The version this request goes to: drawn by the traffic split among the ready versions (a canary); with
        no split, the newest ready one; ``""`` (Triton's choice) when Triton listed no version. ``exclude``: a
        version Triton just refused (unloaded since this entry was read)."""
        ready = [v for v in self.versions if v.state == "READY" and v.version != exclude]
        weighted = [v for v in ready if v.weight]
        if weighted:
            if len(weighted) == 1:
                return weighted[0].version
            return random.choices([v.version for v in weighted], [v.weight or 0.0 for v in weighted])[0]
        if any(v.weight is not None for v in self.versions) and exclude is None:  # no ready version in the split
            return max(self.versions, key=lambda v: v.weight or 0.0).version
        return ready[-1].version if ready else ""

    @property
    def served(self) -> bool:
        return self.reason is None

    @property
    def task(self) -> str | None:
        return self.card.task if self.card is not None else None


@dataclass(frozen=True)
class Snapshot:
    """The catalog at one moment: every model Triton lists, and the served ones per task (default first)."""

    entries: dict[str, Entry] = field(default_factory=dict)
    by_task: dict[str, tuple[str, ...]] = field(default_factory=dict)
    taken_at: float = 0.0
    #: Triton's unavailable count when this was taken (see :attr:`TritonBackend.unavailable_count`).
    generation: int = -1
    #: Triton's repository index it was built from (see :func:`index_key`).
    index: tuple[tuple[str, str, str], ...] = ()

    def served(self, task: str) -> tuple[str, ...]:
        return self.by_task.get(task, ())

    @property
    def split(self) -> bool:
        """Some model splits its traffic between versions (a canary): its weights can change with no sign in the
        repository index, so a refresh must read the configs again."""
        return any(v.weight is not None for e in self.entries.values() for v in e.versions)

    @property
    def complete(self) -> bool:
        """Nothing loading and something served: no reason to look again before Triton changes."""
        return any(self.by_task.values()) and all(e.state in ("READY", NOT_LOADED) for e in self.entries.values())


def routed_tasks() -> tuple[str, ...]:
    """Names of the tasks with a ``/v1`` route (``unroll.tasks``: ``Task.route``)."""
    return tuple(t.name for t in tasks.routed())


class Catalog:
    """The served models, discovered from Triton on demand (see the module docstring)."""

    def __init__(self, backend: TritonBackend, settings: Settings) -> None:
        self.backend, self.settings = backend, settings
        self._snapshot: Snapshot | None = None
        self._lock = asyncio.Lock()
        self._dirty = False

    async def snapshot(self, refresh: bool = False) -> Snapshot:
        """The current catalog; rebuilt first when stale (or ``refresh``), at most once per :data:`MIN_REFRESH_S`."""
        snap = self._snapshot
        if snap is not None and not refresh and not self._dirty and not self._stale(snap):
            return snap
        async with self._lock:
            snap = self._snapshot
            if snap is None or self._dirty or self.backend.unavailable_count != snap.generation or (
                    (refresh or not snap.complete) and time.monotonic() - snap.taken_at >= MIN_REFRESH_S):
                self._dirty = False
                snap = self._snapshot = await self._discover()
            return snap

    @property
    def last_known(self) -> Snapshot | None:
        """The catalog as last read from Triton (``None`` before the first read), whatever Triton's state now."""
        return self._snapshot

    def invalidate(self) -> None:
        """Re-read Triton at the next request: what it serves changed under us (a version was unloaded)."""
        self._dirty = True

    async def keep_fresh(self, period_s: float) -> None:
        """Look at Triton every ``period_s`` until cancelled (the app's lifespan runs it), so versions loaded,
        unloaded or re-weighted by ``unroll deploy`` reach the routes without a request paying for the look.

        One call (the repository index) when nothing changed; the whole catalog is read again when the index
        differs (a version loaded or unloaded, a model's state) or while a model splits its traffic."""
        while True:
            await asyncio.sleep(period_s)
            try:
                index = await self.backend.repository_index()
                snap = self._snapshot
                if snap is not None and not snap.split and index_key(index) == snap.index:
                    continue
                async with self._lock:
                    self._snapshot = await self._discover(index)
            except TritonError as e:  # Triton down: requests see it and say so; try again next period
                log.debug("gateway: catalog refresh failed: %s", e)

    def batch_limit(self, name: str) -> int:
        """The most items one call to ``name`` may carry, from the current snapshot (1 while it is unknown)."""
        entry = self._snapshot.entries.get(name) if self._snapshot is not None else None
        return entry.info.batch_limit if entry is not None and entry.info is not None else 1

    def _stale(self, snap: Snapshot) -> bool:
        return self.backend.unavailable_count != snap.generation or not snap.complete

    async def resolve(self, model: str | None, task: str) -> Entry:
        """The served model of ``task`` called ``model`` (default: the task's first); 404 when there is none."""
        snap = await self.snapshot()
        if model is not None and model not in snap.served(task):
            snap = await self.snapshot(refresh=True)  # it may have been loaded since
        served = snap.served(task)
        if model is None:
            if not served:
                self._unread(f"Triton serves no {task} model that the gateway could read", *snap.entries.values())
                raise ApiError(404, "unknown_model", f"Triton serves no {task} model (see GET /v1/models)")
            return snap.entries[served[0]]
        if model not in served:
            entry = snap.entries.get(model)
            self._unread(f"the gateway could not read {model!r} from Triton", entry)
            why = f" ({entry.reason})" if entry is not None and entry.reason else ""
            raise ApiError(404, "unknown_model",
                           f"unknown {task} model {model!r}{why}; served: {', '.join(served) or 'none'}")
        return snap.entries[model]

    def _unread(self, said: str, *candidates: Entry | None) -> None:
        """503 (with ``Retry-After``) instead of a 404 when what was asked for may be among ``candidates`` whose
        config Triton did not give the last time it was read (:data:`UNREAD`): not known to be absent, and read
        again soon."""
        unread = [e for e in candidates if e is not None and e.state == UNREAD]
        if unread:
            why = "; ".join(f"{e.name}: {e.reason}" for e in unread)
            raise ApiError(503, "model_unavailable", f"{said} ({why}); it reads Triton's models again within "
                           f"{MIN_REFRESH_S:g} s", {"Retry-After": str(self.settings.retry_after_s)})

    async def loaded(self, name: str) -> Entry:
        """The model Triton has loaded as ``name``, served on a ``/v1`` route or not (the ``/v2`` front takes any);
        404 when there is none, with the catalog's reason when it knows one."""
        entry = None
        for refresh in (False, True):  # it may have been loaded since (a refresh at most once per MIN_REFRESH_S)
            entry = (await self.snapshot(refresh=refresh)).entries.get(name)
            if entry is not None and entry.info is not None:
                return entry
        self._unread(f"the gateway could not read {name!r} from Triton", entry)
        why = f" ({entry.reason})" if entry is not None and entry.reason else ""
        raise ApiError(404, "unknown_model", f"Triton has no loaded model {name!r}{why}")

    async def companion(self, name: str, of: str, task: str) -> Entry:
        """The loaded model ``name`` that ``of``'s card names for ``task`` (e.g. its λ rule), with its own card."""
        snap = await self.snapshot()
        entry = snap.entries.get(name)
        if entry is None or entry.card is None or entry.info is None:
            entry = (await self.snapshot(refresh=True)).entries.get(name)
        if entry is None or entry.card is None or entry.info is None:
            why = "not in Triton's repository" if entry is None else entry.reason
            raise ApiError(503, "model_unavailable", f"{of}'s card names {name!r} as its {task}, but it is not "
                           f"available: {why}", {"Retry-After": str(self.settings.retry_after_s)})
        if entry.card.task != task:
            raise ApiError(503, "model_unavailable",
                           f"{of}'s card names {name!r} as its {task}, but that model's card says {entry.card.task}")
        return entry

    # ------------------------------------------------------------------ discovery

    async def _discover(self, index: list[dict[str, str]] | None = None) -> Snapshot:
        generation = self.backend.unavailable_count
        if index is None:
            index = await self.backend.repository_index()
        rows: dict[str, list[dict[str, str]]] = {}
        for m in index:  # one row per version of a loaded model
            if m["name"]:
                rows.setdefault(m["name"], []).append(m)
        entries = await asyncio.gather(*(self._entry(r) for r in rows.values()))
        by_name = {e.name: e for e in sorted(entries, key=lambda e: e.name)}
        by_name = self._apply_settings(by_name)
        by_task = {task: self._served(by_name, task) for task in routed_tasks()}
        snap = Snapshot(by_name, by_task, time.monotonic(), generation, index_key(index))
        log.info("gateway: Triton serves %s", "; ".join(f"{t}: {', '.join(n) or 'none'}" for t, n in by_task.items()))
        return snap

    async def _entry(self, rows: list[dict[str, str]]) -> Entry:
        versions = sorted((r for r in rows if r["version"].isdigit() and r["state"] in LIVE_STATES),
                          key=lambda r: int(r["version"]))
        m = next((r for r in versions if r["state"] == "READY"), (versions or rows)[0])  # ready if a version is
        name, state = m["name"], m["state"] or NOT_LOADED
        if state == NOT_LOADED:
            return Entry(name, state, reason="in Triton's repository but not loaded (not among the models it was "
                                             "started with)")
        if state != "READY":
            detail = f": {m['reason']}" if m["reason"] else ""
            return Entry(name, state, reason=f"not loaded in Triton ({state}{detail})")
        try:
            meta, cfg = await asyncio.gather(self.backend.model_metadata(name), self.backend.model_config(name))
            info = model_info(name, meta, cfg)
        except TritonError as e:
            return Entry(name, UNREAD, reason=f"cannot read its config from Triton: {e}")
        raw = ((cfg.get("parameters") or {}).get(CARD_KEY) or {}).get("string_value")
        if not raw:
            return Entry(name, state, info=info, reason=f"no model card in its Triton config (parameters"
                                                        f"[{CARD_KEY!r}]); write the repository with `unroll repo`")
        try:
            card = ModelCard.from_json(raw, f"Triton config of {name}")
            traffic = parse_traffic(((cfg.get("parameters") or {}).get(TRAFFIC_KEY) or {}).get("string_value", ""),
                                    name)
        except (CardError, UnrollError) as e:
            return Entry(name, state, info=info, reason=str(e))
        listed = tuple(Version(r["version"], r["state"] or NOT_LOADED,
                               traffic.get(int(r["version"]), 0.0) if traffic else None) for r in versions)
        return Entry(name, state, card, info, _why_not_routed(card, info), listed)

    def _apply_settings(self, entries: dict[str, Entry]) -> dict[str, Entry]:
        """Narrow each task to the models the operator configured (if any); configured but unusable names are
        listed with the reason, so ``/readyz`` and ``/v1/models`` show the mistake."""
        out = dict(entries)
        for task in routed_tasks():
            wanted = self.settings.configured(task)
            if not wanted:
                continue
            var = ENV_PREFIX + str(tasks.get(task).route.setting).upper()
            for name, e in entries.items():
                if e.served and e.task == task and name not in wanted:
                    out[name] = Entry(name, e.state, e.card, e.info, f"not in {var}")
            for name in wanted:
                e = out.get(name)
                if e is None:
                    out[name] = Entry(name, "MISSING", reason=f"named in {var} but not in Triton's repository")
                elif e.served and e.task != task:
                    out[name] = Entry(name, e.state, e.card, e.info, f"named in {var} but its card says {e.task}")
        return out

    def _served(self, entries: dict[str, Entry], task: str) -> tuple[str, ...]:
        names = [n for n, e in entries.items() if e.served and e.task == task]  # sorted by name
        order = {n: i for i, n in enumerate(self.settings.configured(task))}
        return tuple(sorted(names, key=lambda n: (order.get(n, len(order)), n)))


def index_key(index: list[dict[str, str]]) -> tuple[tuple[str, str, str], ...]:
    """What of Triton's repository index a catalog depends on: each row's model, version and state."""
    return tuple(sorted((m["name"], m["version"], m["state"]) for m in index))


def _why_not_routed(card: ModelCard, info: ModelInfo) -> str | None:
    """``None`` when ``/v1`` can serve this model; else why not (its task has no route, its tensors differ)."""
    reason = tasks.get(card.task).not_served_reason(card)
    if reason is not None:
        return reason
    wanted_in = [card.input.name] + [c.input for c in (card.lam, card.sigma) if c is not None]
    missing = [n for n in wanted_in if n not in info.inputs] + [n for n in (card.output,) if n not in info.outputs]
    if missing:
        return (f"its card names tensor(s) {', '.join(missing)} that Triton's model lacks (inputs "
                f"{list(info.inputs)}, outputs {list(info.outputs)})")
    if card.input.colour is None:
        return "its card's input is not an image (input.colour is unset)"
    return None
