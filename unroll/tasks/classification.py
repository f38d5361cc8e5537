"""Image classification: logits ``[batch, classes]``, gated on top-1 agreement and accuracy, served as top-k labels."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unroll.tasks.base import ModelCard, Route, Task, register

if TYPE_CHECKING:
    import numpy as np

NAME = "classification"


class Classification(Task):
    """Labels from the card, λ of a sparse-coding front end as an optional input, top-k answers."""

    def check(self, card: ModelCard) -> None:
        if card.labels is not None and len(card.labels) < 2:
            raise ValueError("a classifier needs at least 2 labels")

    def card_defaults(self, shape: tuple[int, ...]) -> dict[str, Any]:
        return {"input": {"resize": "stretch" if min(shape[1:]) > 0 else "none"}}

    def listing(self, card: ModelCard, output_shape: tuple[int, ...]) -> dict[str, Any]:
        n = len(card.labels) if card.labels else output_shape[-1]
        params = {"top_k": f"1…{n}"}
        if card.lam is not None:
            hi = "∞" if card.lam.max is None else f"{card.lam.max:g}"
            params["lam"] = f"{card.lam.min:g}…{hi}" + (" | auto" if card.lam.auto else "")
        return {"params": params, "lam_auto": card.lam is not None and card.lam.auto is not None}

    def sample(self, card: ModelCard, image: np.ndarray, label: int | None, out: Path) -> np.ndarray:
        if label is not None:  # the expected answer beside the image
            (out / f"{card.name}.label.txt").write_text(f"{card.labels[label] if card.labels is not None else label}\n")
        return image

    def banner(self, base: str, card: ModelCard, sample: Path, auth: str) -> list[str]:
        url = f"{base}/v1{self.route.path}?model={card.name}&top_k=3"
        form = shlex.quote(f"image=@{sample}")
        lines = [f"  curl{auth} -F {form} '{url}'"]
        if card.lam is not None and card.lam.auto is not None:
            lines.append(f"  curl{auth} -F {form} '{url}&lam=auto'")
        if card.iters is not None and len(card.iters.counts) > 1:  # another count: the next above the trained one
            others = [k for k in card.iters.counts if k != card.iters.default]
            k = min((k for k in others if k > (card.iters.default or 0)), default=max(others))
            lines.append(f"  curl{auth} -F {form} '{url}&iters={k}'")
        return lines


TASK = register(Classification(
    name=NAME, description="image → class logits",
    # fp32 (a TensorRT engine against ONNX Runtime) also bounds the logits: same classes with drifted scores fail.
    gates={"fp32": {"top1_agreement": 0.999, "accuracy_loss": 0.001, "rel_err": 1e-4},
           "fp16": {"top1_agreement": 0.999, "accuracy_loss": 0.001},
           "int8": {"top1_agreement": 0.995, "accuracy_loss": 0.003}},
    metrics=("top1_agreement", "accuracy_loss"), data="labelled", logits=True, second_size_case=True,
    io=("image", "logits"), image_input=True, order=0,
    route=Route("/classify", "predictions", "classifier", "Classify an image (top-k labels with probabilities)",
                setting="classify_models")))
