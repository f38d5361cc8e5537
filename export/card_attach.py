"""A card file attached to a graph unroll did not export (``--card FILE`` of fuse, quantize, build and repo): the
JSON read as a :class:`~unroll.card.ModelCard`, checked against the graph's input and output names, and written
into the ONNX, so every later stage reads the model's facts from the graph as it does for unroll's own exports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx

from unroll.card import CardError, ModelCard, write_to_onnx


def load_card_file(path: str | Path, name: str) -> ModelCard:
    """A :class:`ModelCard` from a JSON file, named ``name`` (the ONNX file stem, which Triton serves it as).

    A card without ``name`` gets ``name``; one with another name is an error (the model would be served
    under a name its card does not have).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise CardError(f"--card {path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise CardError(f"--card {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise CardError(f"--card {path}: a card is a JSON object, not {type(data).__name__}")
    if data.setdefault("name", name) != name:
        raise CardError(f"--card {path}: the card is named {data['name']!r} but the graph is {name!r} (its file "
                        "stem, the name Triton serves it under); fix the card's name or rename the file")
    data.update(origin="file", origin_file=path.name)  # messages asking for a field name it in this file
    return ModelCard.from_json(json.dumps(data), f"--card {path}")


def check_card_fits(model: onnx.ModelProto, card: ModelCard, where: str = "--card") -> None:
    """The card's input/output names must be the graph's (every later stage feeds the graph by them)."""
    inits = {i.name for i in model.graph.initializer}
    ins = [i.name for i in model.graph.input if i.name not in inits]
    outs = [o.name for o in model.graph.output]
    missing = [n for n in card.input_names if n not in ins]
    if missing:
        raise CardError(f"{where}: the card names input(s) {missing} but the graph's inputs are {ins}")
    extra = [n for n in ins if n not in card.input_names]
    if extra:
        raise CardError(f"{where}: the graph has input(s) {extra} that the card does not declare "
                        f"(card inputs: {card.input_names})")
    if card.output not in outs:
        raise CardError(f"{where}: the card's output {card.output!r} is not a graph output ({outs})")


def attach_card(onnx_path: str | Path, card_file: str | Path, name: str | None = None) -> ModelCard:
    """Write the card in ``card_file`` into ``onnx_path`` (replacing any card there); returns it.

    ``name`` defaults to the file stem up to its first dot (``m.fp16.onnx`` → ``m``). The card is validated
    and checked against the graph's input/output names before the file is rewritten (atomically).
    """
    onnx_path = Path(onnx_path)
    name = name or onnx_path.name.split(".")[0]
    card = load_card_file(card_file, name)
    model = onnx.load(str(onnx_path))
    check_card_fits(model, card, f"--card {card_file}")
    write_to_onnx(model, card)
    tmp = onnx_path.with_name(onnx_path.name + ".tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, onnx_path)
    return card


def attach_card_where_present(onnx_paths: list[Path], card_file: str | Path | None,
                              name: str | None = None) -> ModelCard | None:
    """``--card`` plumbing for quantize/build/repo: attach ``card_file`` (named ``name``) to each of
    ``onnx_paths`` that exists (the FP32 graph and its quantized ones)."""
    if card_file is None:
        return None
    card = None
    for p in dict.fromkeys(Path(p) for p in onnx_paths):
        if p.exists():
            card = attach_card(p, card_file, name)
    return card


NO_CARD_HINT = "or attach a card to it with --card FILE (JSON of an unroll ModelCard)"
