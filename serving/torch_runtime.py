"""The ``torch`` runtime: the registered PyTorch module a served graph was exported from, run in the Python backend
on the instance's device — the CPU here, ``cuda:N`` for a ``KIND_GPU`` instance — with the call of every session of
:func:`unroll.serving.runtimes.open_session` (``run(feeds) -> outputs``, ``.runtime``, ``.inputs``), and
``run.tensors(feeds)``: the same call on PyTorch tensors, answering tensors on the device (the Python backend's
DLPack path, no host round trip for tensors already there).

Which module: the card's model from the registry with its committed weights, wrapped and fed as the ONNX export
fed it (λ an input when the card has one, σ for a denoiser); an iteration companion (``companion_of``) is its model
with ``iters.default`` solver steps. Before it serves, it must answer as the graph it stands in for: both run the
same seeded input (the card's shape, value range, λ default, σ gate level) and must agree within the export's
tolerance (:data:`PARITY_MAX_ABS`). A graph exported from another checkpoint, or one with no PyTorch code behind it
(a third-party ONNX, a λ rule), is refused with the reason — it is never answered by another model.

**Half precision** (``half``: ``float16`` on a GPU, ``bfloat16`` too): only behind the card's FP16 gate, decided at
load on the instance's device. The module in half precision (inputs cast in, outputs cast back to FP32) is compared
with the same module in FP32 on the card's gate data (:func:`unroll.gates.gate_cases`: its gate split and stress
set) with the card's ``fp16`` tolerances (``card.gate("fp16")``, also for bfloat16, which has fewer mantissa bits),
as ``unroll quantize`` gates its FP16 graphs; the main output is gated. A refusal (a missed tolerance, or no gate
data) serves FP32 and says why: ``run.precision`` is what serves, ``run.precision_note`` the verdict.

**CUDA graphs** (``cuda:N``): small unrolled models are launch-bound (``gpu_check``: the eager digit classifier at
batch 1 spends its time launching kernels), so calls replay CUDA graphs (:class:`_Graphs`: static input buffers, a
warm-up on a side stream, one capture; each call copies its inputs in, replays and clones its rows of the outputs).
At load, one graph per batch size the dynamic batcher forms (``batch_sizes``, :func:`capture_sizes`: 1, the
config's ``preferred_batch_size`` and ``max_batch_size``) at the card's fixed input shape; where the card leaves H×W
free (the denoiser) nothing is captured at load and each shape met is captured on first use (said in a log line).
**A batch smaller than a captured size is padded up to the nearest captured size** (:func:`padded_batch`; the
padding rows are whatever the static buffers held, a previous real input: rows never mix, their outputs are
dropped) and the outputs sliced to its rows, so steady-state serving never captures. A shape with no graph yet is
captured on first use (lazily, the fallback), at the padded size; at most :data:`MAX_GRAPHS` lazily captured graphs
are kept (least recently used dropped; the load-time ones stay). PyTorch is imported only when a session opens.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from unroll.errors import RuntimeUnavailable
from unroll.serving.runtimes import Session

log = logging.getLogger("unroll.serving")

#: Largest difference from the graph (max abs) at which the module may stand in for it (the ONNX export's own
#: tolerance against PyTorch).
PARITY_MAX_ABS = 1e-4
#: Lazily captured CUDA graphs kept at once (each holds its static buffers on the device); load-time ones stay.
MAX_GRAPHS = 16
#: Calls on a side stream before a capture (CUDA's lazy initialisations and cuDNN's choices happen outside it).
WARMUP_CALLS = 3
#: The spatial side of the parity input where the card leaves it free (-1).
PARITY_SIDE = 64
#: Half-precision dtypes the runtime serves behind the card's fp16 gate, by their short names.
HALF = {"float16": "fp16", "bfloat16": "bf16"}
#: The card's gate these run behind (``card.gate(GATE_PRECISION)``).
GATE_PRECISION = "fp16"


def capture_sizes(max_batch_size: int, preferred: Sequence[int] = ()) -> list[int]:
    """The batch sizes whose CUDA graphs are captured at load: 1, each preferred size and ``max_batch_size`` (sizes
    outside 1..max dropped); none for a model without batching (``max_batch_size`` 0)."""
    if max_batch_size < 1:
        return []
    return sorted({1, max_batch_size, *(int(p) for p in preferred if 1 <= int(p) <= max_batch_size)})


def padded_batch(n: int, sizes: Sequence[int]) -> int:
    """The captured size a batch of ``n`` runs at: the smallest of ``sizes`` that holds it, else ``n`` itself."""
    return min((s for s in sizes if s >= n), default=n)


def set_tf32(on: bool) -> None:
    """TF32 for FP32 matmuls and convolutions on or off (the GPU benchmarks time both; served FP32 keeps it off).

    The legacy flags on purpose: reading them (as Inductor does) after the newer per-backend ``fp32_precision``
    API was used raises "mix of the legacy and new APIs", while the legacy setters keep both views consistent.
    """
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy setters' deprecation notice
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


def torch_session(graph: str | Path, threads: int, device: str = "cpu", cuda_graphs: bool = True,
                  half: str | None = None, batch_sizes: Sequence[int] = ()) -> Session:
    """A session running the PyTorch module behind ``graph`` (an exported ONNX file: its card names the model) on
    ``device`` with ``threads`` CPU threads. Raises :class:`RuntimeUnavailable` with the reason when there is no
    such module or it does not answer as the graph.

    ``half`` (``float16`` / ``bfloat16``): serve in that precision if the module passes the card's fp16 gate on this
    device, else FP32 (module doc). ``batch_sizes``: the batch sizes to capture CUDA graphs of at load
    (:func:`capture_sizes`; CUDA only), every input's first axis being the batch."""
    import torch

    from unroll.card import CardError, from_onnx

    if half is not None and half not in HALF:
        raise ValueError(f"half must be one of {', '.join(HALF)}, not {half!r}")
    try:
        card = from_onnx(graph)
    except CardError as e:
        raise RuntimeUnavailable(f"{graph}: {e}") from None
    module, ins = _module(card)
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        # FP32 means FP32: PyTorch lets cuDNN's convolutions use TF32 by default (a 10-bit mantissa), far coarser than
        # the parity this module must hold against its graph (PARITY_MAX_ABS: the eager-tf32 rows of
        # benchmarks/results/gpu_check.h200.md, measured on an H200, miss it; eager-fp32 holds it). Reduced
        # precision goes behind its gate instead (``half``). The stub serves this one model, so the switch is its own.
        set_tf32(False)
    module = module.to(dev).eval()
    call = fp32 = _outputs(module, card)
    lock = threading.Lock()
    graphs: _Graphs | None = None

    def tensors(feeds: dict[str, Any]) -> dict[str, Any]:
        extra, missing = feeds.keys() - set(ins), set(ins) - feeds.keys()
        if extra or missing:
            raise ValueError(f"{'unknown' if extra else 'missing'} input(s) {sorted(extra or missing)}; the model's "
                             f"inputs are {ins}")
        args = [_as_tensor(feeds[k]) for k in ins]
        with lock, torch.inference_mode():
            if graphs is not None:
                out = graphs.run(args)
            else:
                torch.set_num_threads(threads)  # the calling thread's setting (Triton calls from its own threads)
                out = call(*(a.to(dev) for a in args))
        return dict(zip(card.output_names, out, strict=True))

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: np.ascontiguousarray(t.detach().to("cpu").numpy()) for n, t in tensors(feeds).items()}

    run.tensors = tensors  # type: ignore[attr-defined]
    run.runtime = "torch"  # type: ignore[attr-defined]
    run.device = str(dev)  # type: ignore[attr-defined]
    run.inputs = _check_parity(run, graph, card, ins)  # type: ignore[attr-defined]
    run.precision, run.precision_note = "fp32", None  # type: ignore[attr-defined]
    if half is not None:
        halved = copy.deepcopy(module).to(getattr(torch, half))
        candidate = _cast(_outputs(halved, card), getattr(torch, half))
        verdict = half_gate(card, ins, fp32, candidate, dev, half)
        run.precision_note = verdict.note  # type: ignore[attr-defined]
        if verdict.passed:
            call = candidate
            run.precision = HALF[half]  # type: ignore[attr-defined]
            del module, fp32  # the FP32 weights leave the device
        log.log(logging.INFO if verdict.passed else logging.WARNING, "torch runtime: %s", verdict.note)
    if dev.type == "cuda" and cuda_graphs:
        graphs = _Graphs(_cuda_capture(call, dev), batch_sizes, call, dev)
        fixed = all(d > 0 for d in card.input.shape)
        if batch_sizes and fixed:
            with lock, torch.inference_mode():
                for b in batch_sizes:
                    feeds = parity_feeds(card, ins, b)
                    graphs.prepare([torch.from_numpy(feeds[k]) for k in ins])
        elif batch_sizes:
            log.info("torch runtime: %s takes any H×W (card input.shape %s): CUDA graphs are captured on first use "
                     "of each shape, at the batch sizes %s", card.name, list(card.input.shape), list(batch_sizes))
    return run


class GateVerdict:
    """The card's fp16 gate on a half-precision module: ``passed``, and ``note`` (what was asked, the metrics or the
    reason for a refusal)."""

    def __init__(self, passed: bool, note: str) -> None:
        self.passed, self.note = passed, note


def half_gate(card: Any, ins: list[str], reference: Callable, candidate: Callable, device: Any,
              half: str = "float16") -> GateVerdict:
    """``candidate`` (the module in half precision) against ``reference`` (FP32) on the card's gate data with the
    card's fp16 tolerances, as ``unroll quantize`` gates an FP16 graph (:func:`unroll.gates.evaluate`)."""
    import torch

    from unroll import gates
    from unroll.errors import CardError

    asked = f"{card.name}: {half} asked for on {device}"
    try:
        tol = gates.tolerances(card, GATE_PRECISION)
        cases = gates.gate_cases(card)
    except CardError as e:
        return GateVerdict(False, f"{asked}; serving FP32: no gate data to check it on ({e})")
    if not tol:
        return GateVerdict(False, f"{asked}; serving FP32: the card has no {GATE_PRECISION} gate")

    def runner(call: Callable) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
        def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
            with torch.inference_mode():
                out = call(*(_as_tensor(feeds[k]).to(device) for k in ins))[0]
            return out.float().cpu().numpy()
        return run

    res = gates.evaluate(card, cases, runner(reference), runner(candidate), tol)
    where = gates.gate_source(card, cases)
    if not res.passed:
        return GateVerdict(False, f"{asked}; the card's {GATE_PRECISION} gate refused it on {where}: "
                           f"{'; '.join(res.failures)}; serving FP32")
    shown = ", ".join(f"{k} {gates.METRICS[k].format(float(res.metrics[k]))} (tolerance "
                      f"{gates.METRICS[k].format(v)})" for k, v in tol.items() if k in res.metrics)
    return GateVerdict(True, f"{asked}; passed the card's {GATE_PRECISION} gate on {where}: {shown}")


def _as_tensor(a: Any) -> Any:
    """A float32 tensor of ``a`` (a NumPy array — copied if read-only — or a tensor, left where it is)."""
    import torch

    if isinstance(a, np.ndarray):
        return torch.from_numpy(np.require(a, np.float32, ["C", "W"]))
    return a if a.dtype == torch.float32 else a.float()


def _cast(call: Callable, dtype: Any) -> Callable:
    """``call`` taking and answering FP32 around a module in ``dtype`` (the casts are part of a captured graph)."""
    import torch

    return lambda *args: tuple(o.to(torch.float32) for o in call(*(a.to(dtype) for a in args)))


def why_not(card: Any) -> str | None:
    """Why the card's graph has no PyTorch module to run here (``None``: it has one). Cheap: no weights are read."""
    from unroll.registry import get_spec, list_models

    name = card.companion_of or card.name
    if name not in list_models():
        return (f"{card.name} has no PyTorch code here (not a registered model: a third-party ONNX or a graph "
                "exported elsewhere); serve its graph with onnxruntime or openvino (on a GPU: TensorRT or ONNX "
                "Runtime in NVIDIA's Triton container)")
    spec = get_spec(name)
    if card.task != spec.card.task:
        return (f"{card.name} is {name}'s {card.task} companion, a graph of its own with no PyTorch module here; "
                "serve it with onnxruntime or openvino")
    if not spec.has_weights:
        return f"{name} has no committed weights to run in PyTorch; serve its graph instead"
    return None


def _module(card: Any) -> tuple[Any, list[str]]:
    """The registered module the card's graph was exported from, and its inputs in call order."""
    from unroll.registry import load
    from unroll.solvers.iterations import set_iterations

    why = why_not(card)
    if why is not None:
        raise RuntimeUnavailable(why)
    model = load(card.companion_of or card.name, pretrained=True)
    if card.companion_of and card.iters is not None and card.iters.default is not None:
        set_iterations(model, card.iters.default)
    # the graph's inputs in the order the export fed them: the image, then λ (a classifier's second argument) or σ
    ins = [card.input.name, *([card.lam.input] if card.lam is not None else []),
           *([card.sigma.input] if card.sigma is not None else [])]
    return model, ins


def _outputs(module: Any, card: Any) -> Any:
    """``module`` as a call returning the graph's outputs as a tuple (``card.output_names``): its output, and
    where the card declares ``ood`` its first solver layer's residual and code size, computed as the export traced
    them."""
    if card.ood is None:
        return lambda *args: (module(*args),)
    from unroll.solvers.residual import WithResidual

    return WithResidual(module)


def parity_feeds(card: Any, ins: list[str], batch: int = 2) -> dict[str, np.ndarray]:
    """A seeded input of the card's shape and value range (free sides :data:`PARITY_SIDE`), λ at its default, σ at
    the first gate level: what the module and the graph are compared on."""
    rng = np.random.default_rng(0)
    shape = [batch, *(PARITY_SIDE if d < 0 else d for d in card.input.shape)]
    lo, hi = card.input.value_range if card.input.value_range is not None else (0.0, 1.0)
    feeds = {card.input.name: rng.uniform(lo, hi, shape).astype(np.float32)}
    if card.lam is not None and card.lam.input in ins:
        feeds[card.lam.input] = np.full((batch,), card.lam.default or 0.0, np.float32)
    if card.sigma is not None:
        feeds[card.sigma.input] = np.full((batch,), card.sigma.gate_levels[0] / card.sigma.scale, np.float32)
    return feeds


def _check_parity(run: Session, graph: str | Path, card: Any, ins: list[str]) -> dict[str, list[int | None]]:
    """Refuse (:class:`RuntimeUnavailable`) a module that does not answer as ``graph`` (module doc); the graph's
    inputs and their dims (``None`` where dynamic), which the module takes as they are."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feeds = parity_feeds(card, ins)
    if set(names) != set(ins):
        raise RuntimeUnavailable(f"{card.name}: the graph's inputs {names} are not the module's {ins}")
    wants = session.run(card.output_names, {k: _graph_shape(feeds[k], i) for k, i in
                                            zip(names, session.get_inputs(), strict=True)})
    gots = run(feeds)
    err = max(float(np.max(np.abs(got.reshape(want.shape) - want))) if got.size == want.size else float("inf")
              for got, want in zip((gots[n] for n in card.output_names), wants, strict=True))
    if not err <= PARITY_MAX_ABS:
        raise RuntimeUnavailable(f"{card.name}: the PyTorch module does not answer as the served graph (max abs "
                                 f"difference {err:.2e} > {PARITY_MAX_ABS:g}: the graph was exported from other "
                                 "weights or solver settings); serve the graph with onnxruntime or openvino")
    return {i.name: [d if isinstance(d, int) else None for d in i.shape] for i in session.get_inputs()}


def _graph_shape(a: np.ndarray, graph_input: Any) -> np.ndarray:
    """``a`` as the graph takes it: a ``[B]`` tensor for a ``[B]`` input (or ``[B, 1]`` where the graph says so)."""
    rank = len(graph_input.shape)
    return a.reshape(len(a), 1) if a.ndim == 1 and rank == 2 else a


class _Graphs:
    """Replays of ``call`` on static buffers, per (batch size, per-row shapes) (module doc): ``run(args)``.

    ``capture(static_inputs)`` records the call on those buffers and returns its replay (answering the static
    outputs); on CUDA :func:`_cuda_capture`. ``sizes``: the batch sizes a batch is padded up to (:func:`padded_batch`;
    none: each shape as it comes). ``call``: the eager call for a shape whose capture failed."""

    def __init__(self, capture: Callable[[list[Any]], Callable[[], tuple]], sizes: Sequence[int], call: Callable,
                 device: Any) -> None:
        self.capture, self.sizes, self.call, self.device = capture, sorted(sizes), call, device
        self._cache: OrderedDict[tuple, tuple[Callable[[], tuple], list[Any]]] = OrderedDict()
        self._pinned: set[tuple] = set()  # captured at load: never dropped
        #: Shapes whose capture failed: run eagerly (logged once each).
        self._eager: set[tuple] = set()

    @staticmethod
    def key(args: list[Any], batch: int) -> tuple:
        return tuple(((batch, *a.shape[1:]), a.dtype) for a in args)

    def prepare(self, args: list[Any]) -> None:
        """Capture at load for ``args``' shapes (a batch of a captured size), kept for good."""
        key = self.key(args, len(args[0]))
        if self._cached_capture(key, args) is not None:
            self._pinned.add(key)

    def run(self, args: list[Any]) -> tuple:
        n = len(args[0])
        m = padded_batch(n, self.sizes) if self.sizes else n
        key = self.key(args, m)
        entry = self._cache.get(key)
        if entry is None and key not in self._eager:
            entry = self._cached_capture(key, [_pad_rows(a, m) for a in args])
        if entry is None:  # a shape whose capture failed
            return self.call(*(a.to(self.device) for a in args))  # the outputs' tuple (``_outputs``)
        self._cache.move_to_end(key)
        replay, static_in = entry
        for buf, a in zip(static_in, args, strict=True):
            buf[:n].copy_(a, non_blocking=True)
        return tuple(t[:n].clone() for t in replay())

    def _cached_capture(self, key: tuple, args: list[Any]) -> tuple[Callable[[], tuple], list[Any]] | None:
        """A new replay for ``key``'s shapes, kept (the least recently used lazy one dropped past
        :data:`MAX_GRAPHS`); ``None`` when it cannot be captured (an op that syncs with the host): that shape runs
        eagerly, said once."""
        static_in = [a.to(self.device).clone() for a in args]
        try:
            replay = self.capture(static_in)
        except RuntimeError as e:
            log.warning("torch runtime: no CUDA graph for input shapes %s (%s); running them eagerly",
                        [s for s, _ in key], str(e).splitlines()[0])
            self._eager.add(key)
            return None
        self._cache[key] = (replay, static_in)
        lazy = [k for k in self._cache if k not in self._pinned]
        for k in lazy[:max(0, len(lazy) - MAX_GRAPHS)]:
            del self._cache[k]
        return self._cache[key]


def _pad_rows(a: Any, m: int) -> Any:
    """``a`` with its last row repeated up to ``m`` rows (a new graph's first contents: real rows)."""
    n = len(a)
    return a if n >= m else a[list(range(n)) + [n - 1] * (m - n)]


def _cuda_capture(call: Callable, device: Any) -> Callable[[list[Any]], Callable[[], tuple]]:
    """The CUDA capture of :class:`_Graphs` (PyTorch's documented whole-network capture: warm-up on a side stream,
    then ``torch.cuda.graph``); each replay answers the same static output tensors."""
    import torch

    def capture(static_in: list[Any]) -> Callable[[], tuple]:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                call(*static_in)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = call(*static_in)

        def replay() -> tuple:
            graph.replay()
            return static_out
        return replay
    return capture
