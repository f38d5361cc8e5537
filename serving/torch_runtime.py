"""The ``torch`` runtime: the registered PyTorch module a served graph was exported from, run in the Python backend
on the instance's device — the CPU here, ``cuda:N`` for a ``KIND_GPU`` instance — with the call of every session of
:func:`unroll.serving.cpu_runtime.open_session` (``run(feeds) -> outputs``, ``.runtime``, ``.inputs``).

Which module: the card's model from the registry with its committed weights, wrapped and fed as the ONNX export
fed it (λ an input when the card has one, σ for a denoiser); an iteration companion (``companion_of``) is its model
with ``iters.default`` solver steps. Before it serves, it must answer as the graph it stands in for: both run the
same seeded input (the card's shape, value range, λ default, σ gate level) and must agree within the export's
tolerance (:data:`PARITY_MAX_ABS`). A graph exported from another checkpoint, or one with no PyTorch code behind it
(a third-party ONNX, a λ rule), is refused with the reason — it is never answered by another model.

On CUDA, small unrolled models are launch-bound (``gpu_check``: the eager digit classifier at batch 1 spends its time
launching kernels), so each input shape met gets a CUDA graph (:class:`_Graphs`): static input buffers, a warm-up on
a side stream, one capture, then each call copies its inputs in, replays and clones the outputs; at most
:data:`MAX_GRAPHS` shapes are kept (least recently used dropped). PyTorch is imported only when a session opens.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from unroll.errors import RuntimeUnavailable
from unroll.serving.cpu_runtime import Session

log = logging.getLogger("unroll.serving")

#: Largest difference from the graph (max abs) at which the module may stand in for it (the ONNX export's own
#: tolerance against PyTorch).
PARITY_MAX_ABS = 1e-4
#: Input shapes with a captured CUDA graph at once (each holds its static buffers on the device).
MAX_GRAPHS = 16
#: Calls on a side stream before a capture (CUDA's lazy initialisations and cuDNN's choices happen outside it).
WARMUP_CALLS = 3
#: The spatial side of the parity input where the card leaves it free (-1).
PARITY_SIDE = 64


def torch_session(graph: str | Path, threads: int, device: str = "cpu", cuda_graphs: bool = True) -> Session:
    """A session running the PyTorch module behind ``graph`` (an exported ONNX file: its card names the model) on
    ``device`` with ``threads`` CPU threads. Raises :class:`RuntimeUnavailable` with the reason when there is no
    such module or it does not answer as the graph."""
    import torch

    from unroll.card import CardError, from_onnx

    try:
        card = from_onnx(graph)
    except CardError as e:
        raise RuntimeUnavailable(f"{graph}: {e}") from None
    module, ins = _module(card)
    torch.set_num_threads(threads)
    dev = torch.device(device)
    call = _outputs(module.to(dev).eval(), card)
    graphs = _Graphs(call, dev) if dev.type == "cuda" and cuda_graphs else None
    lock = threading.Lock()

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        extra, missing = feeds.keys() - set(ins), set(ins) - feeds.keys()
        if extra or missing:
            raise ValueError(f"{'unknown' if extra else 'missing'} input(s) {sorted(extra or missing)}; the model's "
                             f"inputs are {ins}")
        args = [torch.from_numpy(np.require(feeds[k], np.float32, ["C", "W"])) for k in ins]
        with lock, torch.inference_mode():
            if graphs is not None:
                out = graphs.run(args)
            else:
                torch.set_num_threads(threads)  # the calling thread's setting (Triton calls from its own threads)
                out = call(*(a.to(dev) for a in args))
        return {n: np.ascontiguousarray(t.detach().to("cpu").numpy())
                for n, t in zip(card.output_names, out, strict=True)}

    run.runtime = "torch"  # type: ignore[attr-defined]
    run.device = str(dev)  # type: ignore[attr-defined]
    run.inputs = _check_parity(run, graph, card, ins)  # type: ignore[attr-defined]
    return run


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
    where the card declares ``ood`` its first solver layer's residual, computed as the export traced it."""
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
    """CUDA graphs of ``module`` per input shape (module doc): ``run(args)`` with host or device tensors."""

    def __init__(self, module: Any, device: Any) -> None:
        self.module, self.device = module, device
        self._cache: OrderedDict[tuple, tuple[Any, list[Any], Any]] = OrderedDict()
        #: Shapes whose capture failed: run eagerly (logged once each).
        self._eager: set[tuple] = set()

    def run(self, args: list[Any]) -> Any:
        import torch

        key = tuple((tuple(a.shape), a.dtype) for a in args)
        entry = self._cache.get(key)
        if entry is None and key not in self._eager:
            entry = self._cached_capture(key, args)
        if entry is None:  # a shape whose capture failed
            return self.module(*(a.to(self.device) for a in args))  # the outputs' tuple (``_outputs``)
        self._cache.move_to_end(key)
        graph, static_in, static_out = entry
        for buf, a in zip(static_in, args, strict=True):
            buf.copy_(a, non_blocking=True)
        graph.replay()
        out = tuple(t.clone() for t in static_out)
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def _cached_capture(self, key: tuple, args: list[Any]) -> tuple[Any, list[Any], Any] | None:
        """A new graph for ``key``'s shapes, kept (the least recently used dropped past :data:`MAX_GRAPHS`); ``None``
        when it cannot be captured (an op that syncs with the host): that shape runs eagerly, said once."""
        try:
            entry = self._capture(args)
        except RuntimeError as e:
            log.warning("torch runtime: no CUDA graph for input shapes %s (%s); running them eagerly",
                        [s for s, _ in key], str(e).splitlines()[0])
            self._eager.add(key)
            return None
        self._cache[key] = entry
        while len(self._cache) > MAX_GRAPHS:
            self._cache.popitem(last=False)
        return entry

    def _capture(self, args: list[Any]) -> tuple[Any, list[Any], Any]:
        import torch

        static_in = [a.to(self.device).clone() for a in args]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                self.module(*static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.module(*static_in)
        return graph, static_in, static_out
