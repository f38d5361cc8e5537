"""Anytime serving: under load, the largest solver iteration count whose answer still meets the deadline.

A model whose card serves several iteration counts (``iters``) runs the same weights at each, each count a graph of
its own. With an objective in force (the deployment's ``slo``, or a request's own ``deadline_ms``), a request that
does not pin ``iters`` gets the largest count whose predicted latency fits the time it has left, with
:data:`HEADROOM` to spare (slack-fit, after SuperServe): the predicted latency at count ``k`` is the work in flight
ahead of it divided by the rate the backend drains work, plus ``k``'s own service time for the request's size.
Both are learned from the answers this process sees: a count's service time per unit of work from requests that
found nothing in flight, the drain rate from the work answered per second of busy time over the last
:data:`WINDOW` answers (so it takes in the batching that answers several at once, and load this process cannot
see: other workers, other models on the same cores). A pinned count is never changed; without an objective nothing
here changes which graph answers (the flights are still counted, so the estimates are warm when a request brings
its own deadline).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

#: Weight of a new observation in the running estimates (exponentially weighted).
ALPHA = 0.2
#: Bounds of the learned drain rate (ms of work answered per ms busy): below 1, load this process cannot see shares
#: the backend; above 1, the backend answers several at once (batches, instances).
PARALLEL_RANGE = (0.1, 64.0)
#: Answers the drain rate is measured over.
WINDOW = 64
#: Unqueued answers per count whose median is its service time (the median: a cold start's outlier is not it).
SAMPLES = 15
#: Bounds of the correction applied to every prediction (recent answers' latency ÷ their prediction): only ever
#: upwards, since the model errs long on purpose (:meth:`Family.ahead_ms`) and a correction down would undo that.
BIAS_RANGE = (1.0, 8.0)
#: Share of the time left that a count's predicted latency may fill (the rest absorbs the prediction's error).
HEADROOM = 0.7


@dataclass(eq=False)
class _Flight:
    k: int
    work: float
    predicted_ms: float  #: this request's own service time, as predicted when it was sent
    started: float
    latency_ms: float = 0.0  #: its whole latency (the work ahead included), as predicted when sent, uncorrected


@dataclass
class Family:
    """One model's counts: service time per unit of work per count, the backend's parallelism, what is in flight."""

    counts: tuple[int, ...]
    default: int
    unit: str = "request"  #: what one unit of work is (a request; a megapixel for image-to-image routes)
    cost_ms: dict[int, float] = field(default_factory=dict)  #: learned ms per unit of work, by count
    samples: dict[int, deque] = field(default_factory=dict)  #: the last :data:`SAMPLES` of them, by count
    bias: float = 1.0  #: answers' latency ÷ their prediction, recently (:data:`BIAS_RANGE`)
    parallel: float = 1.0  #: the drain rate (:data:`PARALLEL_RANGE`)
    flights: set[_Flight] = field(default_factory=set)
    busy_since: float = 0.0  #: when the flights last went from none to some
    last_done: float = 0.0
    drained: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  #: (busy ms, work ms answered)
    spent_ms: float = 0.0  #: busy ms over :attr:`drained`
    done_ms: float = 0.0  #: work ms answered over :attr:`drained`

    def cost(self, k: int) -> float | None:
        """``k``'s service time per unit of work: learned, else scaled from the nearest learned count on the
        assumption that a request's fixed overhead costs about one iteration (``(1 + k) / (1 + j)``)."""
        if k in self.cost_ms:
            return self.cost_ms[k]
        if not self.cost_ms:
            return None
        j = min(self.cost_ms, key=lambda c: abs(c - k))
        return self.cost_ms[j] * (1 + k) / (1 + j)

    def ahead_ms(self) -> float:
        """Service time of the requests in flight, as predicted when each was sent (all of it: what has run of
        it is unknown, so the estimate errs long)."""
        return sum(f.predicted_ms for f in self.flights)

    def model_ms(self, k: int, work: float, ahead_ms: float | None = None) -> float | None:
        """``k``'s latency for a request of ``work`` sent now, by the model alone: the work ahead (``ahead_ms``, else
        :meth:`ahead_ms`) drained at the learned rate, then its own service time."""
        c = self.cost(k)
        if c is None:
            return None
        return (self.ahead_ms() if ahead_ms is None else ahead_ms) / self.parallel + c * work

    def predict_ms(self, k: int, work: float, ahead_ms: float | None = None) -> float | None:
        """:meth:`model_ms` corrected by how recent predictions fared (:attr:`bias`)."""
        m = self.model_ms(k, work, ahead_ms)
        return None if m is None else self.bias * m

    def pick(self, work: float, slack_ms: float) -> int:
        """The largest count up to the trained one predicted to answer within :data:`HEADROOM` of ``slack_ms``; the
        lowest where none is; the trained one while nothing is learned yet. Never above the trained count: a count
        the model was not trained at is a manual dial (``iters=K``), not a default the controller may reach for."""
        ahead = self.ahead_ms()
        fits = [k for k in self.counts if k <= self.default and (p := self.predict_ms(k, work, ahead)) is not None
                and p <= HEADROOM * slack_ms]
        if fits:
            return max(fits)
        return self.default if self.cost(self.default) is None else min(self.counts)

    def flight(self, k: int, work: float, now: float, ahead_ms: float) -> _Flight:
        """A request at count ``k`` sent at ``now`` with ``ahead_ms`` of work ahead of it, its predictions made."""
        c = self.cost(k)
        return _Flight(k, work, c * work if c is not None else 0.0, now, self.model_ms(k, work, ahead_ms) or 0.0)

    def start(self, f: _Flight, ahead_ms: float | None = None) -> float:
        """Count ``f`` in flight; the work ahead of it (ms: ``ahead_ms`` where the caller has it, else summed)."""
        ahead = self.ahead_ms() if ahead_ms is None else ahead_ms
        if not self.flights:
            self.busy_since = f.started
        self.flights.add(f)
        return ahead

    def finish(self, f: _Flight, ahead_ms: float, now: float, ok: bool) -> None:
        """``f`` answered at ``now`` (``ok``: successfully): its count's service time when nothing was ahead of it,
        and the drain rate over the busy time since the previous answer."""
        self.flights.discard(f)
        busy = 1000.0 * (now - max(self.last_done, self.busy_since))
        self.last_done = now
        if not ok:
            return
        took = 1000.0 * (now - f.started)
        if ahead_ms <= 0.0:
            recent = self.samples.setdefault(f.k, deque(maxlen=SAMPLES))
            recent.append(took / f.work)
            self.cost_ms[f.k] = float(sorted(recent)[len(recent) // 2])
        if f.latency_ms > 0.0:
            lo, hi = BIAS_RANGE
            self.bias = min(hi, max(lo, (1 - ALPHA) * self.bias + ALPHA * took / f.latency_ms))
        if f.predicted_ms > 0.0 and busy >= 0.0:
            if len(self.drained) == self.drained.maxlen:  # the oldest answer leaves the window
                old_busy, old_done = self.drained[0]
                self.spent_ms, self.done_ms = self.spent_ms - old_busy, self.done_ms - old_done
            self.drained.append((busy, f.predicted_ms))
            self.spent_ms, self.done_ms = self.spent_ms + busy, self.done_ms + f.predicted_ms
            if self.spent_ms > 0.0:
                lo, hi = PARALLEL_RANGE
                self.parallel = min(hi, max(lo, self.done_ms / self.spent_ms))


@dataclass(frozen=True)
class Served:
    """What the controller decided for one request: the count, and whether it chose it (not pinned, not the trained
    count without a deadline)."""

    k: int
    chosen: bool


class Controller:
    """The per-process controller: one :class:`Family` per model with several counts."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}

    def family(self, model: str, counts: tuple[int, ...], default: int) -> Family:
        fam = self.families.get(model)
        if fam is None or fam.counts != counts or fam.default != default:  # a redeployed model: learn it again
            fam = self.families[model] = Family(counts, default)
        return fam

    def decide(self, fam: Family, pinned: int | None, deadline_ms: float | None, arrived: float, work: float) -> Served:
        """The count for a request that arrived at ``arrived`` (``time.perf_counter()``)."""
        if pinned is not None:
            return Served(pinned, False)
        if deadline_ms is None:
            return Served(fam.default, False)
        left = deadline_ms - 1000.0 * (time.perf_counter() - arrived)
        return Served(fam.pick(work, left), True)

    @contextmanager
    def flight(self, fam: Family, k: int, work: float) -> Iterator[None]:
        """Count a request as in flight at count ``k`` while the block runs, and learn from how long it took (an
        answer that failed teaches no service time)."""
        ahead = fam.ahead_ms()
        f = fam.flight(k, work, time.perf_counter(), ahead)
        fam.start(f, ahead)
        ok = False
        try:
            yield
            ok = True
        finally:
            fam.finish(f, ahead, time.perf_counter(), ok)
