"""Dic-ViT (issue 26, item 3): the Dic-Attn ViT in the paper's supplement configuration, registered, exported, served.

* the block at the supplement's size (dim 768) exported on its own: the fused graph matches PyTorch and carries
  none of the textbook shrinkage ops, which the naive (textbook) trace of the same block does;
* the registered ``dic-vit`` (32×32, patch 4, dim 768, depth 7) builds with the expected shapes and parameter
  count, refreshes its Dic-Attn step sizes on construction and on loading, loads checkpoints, and exports
  through the product's ``export_model`` with parity to PyTorch;
* the exported full-size graph is served: repository → a real tritonserver → the real gateway, which must
  classify real photos (scikit-image's, at CIFAR size) with PyTorch's top-k and scores.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from served import check_topk, gateway_over_triton, png, softmax

import unroll
from unroll import data
from unroll.export.fuse import SUSPECT_OPS
from unroll.export.inputs import Case
from unroll.export.onnx_export import export, export_model
from unroll.models.dic_vit import SUPPLEMENT, DicViT, dic_layers, load_checkpoint, refresh_dic
from unroll.registry import get_spec
from unroll.solvers.dic_attn import DicAttention

NAME = "dic-vit"
SMALL = dict(dim=64, depth=2, num_atoms=32, n_steps=3)
FORBIDDEN_OPS = {"Loop", "If", "Scan", "Compress", "NonZero", "RandomNormal", "RandomUniform"}


def photos(side: int = 32) -> torch.Tensor:
    """The bundled colour photos at ``side``² (``[N, 3, side, side]`` in [0, 1]), as Pillow downsizes them."""
    out = []
    for name in data.PHOTOS:
        img = Image.fromarray(data.bundled_image(name, gray=False)[..., :3]).resize((side, side),
                                                                                   Image.Resampling.LANCZOS)
        out.append(np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0)
    return torch.from_numpy(np.stack(out))


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def model() -> DicViT:
    return unroll.load(NAME, pretrained=False)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    """The full-size ``dic-vit`` exported by the product (seeded init, no weights), once for this module."""
    out = tmp_path_factory.mktemp("dic_vit_onnx")
    t0 = time.perf_counter()
    res = export_model(NAME, out, naive=False)
    return SimpleNamespace(res=res, dir=out, seconds=time.perf_counter() - t0)


# --- the block at the supplement's size ----------------------------------------------------------------------------


def test_block_fused_export_at_supplement_size(model: DicViT, tmp_path: Path) -> None:
    """The first block's Dic-Attn (dim 768, its own weights) exported alone: parity, fused shrinkage, dynamic tokens."""
    attn = model.blocks[0].attn
    assert attn.dim == SUPPLEMENT["dim"] == 768
    with torch.no_grad():  # what the block really sees: LN of the photos' patch tokens (64 of them)
        real = model.blocks[0].norm1(model.tokens(photos()))
    gen = torch.Generator().manual_seed(3)
    odd = torch.randn(2, 65, 768, generator=gen)  # another token count (64 patches + 1), random, zero-mean
    card = dict(name="dic-vit-block", task="block", description="the first Dic-ViT block's Dic-Attn (dim 768)",
                output="y", input=dict(name="x", shape=(-1, 768)),
                trt_profile=dict(batch=(1, 2, 4), dims={"0": (1, 65, 128)}))
    res = export(attn, card, [Case("photo tokens", {"x": real}), Case("65 random tokens", {"x": odd})],
                 tmp_path, name="dic-vit-block", naive=True)
    rep = res.report
    for c in rep["parity"]["cases"]:
        assert c["max_abs_err"] <= 1e-4 and c["rel_err"] <= 1e-4, c
    assert {tuple(c["shapes"]["x"][1:]) for c in rep["parity"]["cases"]} == {(64, 768), (65, 768)}
    graph = onnx.load(res.onnx_path)
    ops = {n.op_type for n in graph.graph.node}
    assert not ops & set(SUSPECT_OPS) and not ops & FORBIDDEN_OPS, ops
    hist = rep["op_histogram"]
    assert hist["Clip"] == attn.n_steps  # one fused shrinkage (v − clip(v, −θ, θ)) per ISTA step
    naive = rep["naive_export"]["op_histogram"]
    assert naive.get("Sign", 0) > 0 and naive.get("Abs", 0) > 0  # the textbook trace really is textbook
    assert rep["node_count"] < rep["naive_export"]["node_count"]
    # independently of the exporter's own check: ONNX Runtime vs PyTorch at 65 tokens, batch 3
    x = torch.randn(3, 65, 768, generator=gen)
    got = ort.InferenceSession(str(res.onnx_path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        want = attn(x).double().numpy()
    assert rel_err(got, want) <= 1e-4


# --- the model -----------------------------------------------------------------------------------------------------


def _expected_params(dim: int, depth: int, num_atoms: int, mlp_ratio: float = 4.0, patch: int = 4,
                     tokens: int = 64, classes: int = 10) -> int:
    """Parameter count of the architecture from its layer sizes (written out independently of the module)."""
    hidden = int(dim * mlp_ratio)
    block = (2 * 2 * dim                            # two LayerNorms
             + dim * num_atoms + num_atoms + num_atoms**2  # dictionary, w_D, W_φ
             + dim * dim + dim                      # output projection
             + dim * hidden + hidden + hidden * dim + dim)  # MLP
    return (3 * patch * patch * dim + dim + tokens * dim  # patch embedding, position embedding
            + depth * block + 2 * dim + dim * classes + classes)


def test_supplement_configuration_builds(model: DicViT) -> None:
    spec = get_spec(NAME)
    assert spec.input_shape == (3, 32, 32) and spec.card.labels[3] == "cat" and spec.card.data.test == "photos"
    assert spec.card.input.shape == (3, 32, 32) and spec.card.input.colour == "rgb"
    assert (model.img_size, model.patch_size, model.dim, len(model.blocks)) == (32, 4, 768, 7) == tuple(
        SUPPLEMENT[k] for k in ("img_size", "patch_size", "dim", "depth"))
    assert model.num_tokens == 64 and all(isinstance(b.attn, DicAttention) for b in model.blocks)
    n = sum(p.numel() for p in model.parameters())
    assert n == _expected_params(768, 7, model.blocks[0].attn.num_atoms)
    assert 30e6 < n < 50e6  # the "~40M"
    x = photos()
    with torch.no_grad():
        logits = model(x)
        assert model.tokens(x).shape == (len(x), 64, 768)
    assert logits.shape == (len(x), 10) and torch.isfinite(logits).all()
    # pooled readout: the logits depend on the image (Dic-Attn mixes no tokens, so a class token would not)
    assert (logits - logits.mean(0)).abs().max() > 1e-3
    # each block draws its own dictionary; atoms are unit-norm and L = ‖D‖₂² + μ is current
    d0, d1 = (b.attn.dictionary for b in model.blocks[:2])
    assert not torch.allclose(d0, d1)
    for layer in dic_layers(model):
        assert torch.allclose(layer.dictionary.norm(dim=0), torch.ones(layer.num_atoms), atol=1e-5)
        assert float(layer.lipschitz) == pytest.approx(
            float(torch.linalg.matrix_norm(layer.dictionary.detach(), ord=2)) ** 2 + layer.mu, rel=1e-5)


def test_small_configurations_and_seeds() -> None:
    a = unroll.load(NAME, pretrained=False, **SMALL)
    b = unroll.load(NAME, pretrained=False, **SMALL)
    c = unroll.load(NAME, pretrained=False, seed=1, **SMALL)
    assert sum(p.numel() for p in a.parameters()) == _expected_params(64, 2, 32)
    x = photos()
    with torch.no_grad():
        assert torch.equal(a(x), b(x)) and not torch.allclose(a(x), c(x))
    assert all(layer.n_steps == 3 for layer in dic_layers(a))
    with pytest.raises(ValueError, match="multiple"):
        DicViT(img_size=30, **SMALL)


def test_loading_weights_refreshes_the_step_size() -> None:
    """A state dict whose atoms are not unit-norm and whose L is stale: loading normalises and recomputes."""
    src = unroll.load(NAME, pretrained=False, **SMALL)
    state = src.state_dict()
    gen = torch.Generator().manual_seed(5)
    for k in state:
        if k.endswith("attn.dictionary"):
            state[k] = 3.0 * (state[k] + 0.3 * torch.randn(state[k].shape, generator=gen))
        if k.endswith("attn.lipschitz"):
            state[k] = torch.tensor(123.0)
    dst = unroll.load(NAME, pretrained=False, seed=9, **SMALL)
    dst.load_state_dict(state)
    for layer in dic_layers(dst):
        assert torch.allclose(layer.dictionary.norm(dim=0), torch.ones(layer.num_atoms), atol=1e-5)
        assert float(layer.lipschitz) != 123.0
        assert float(layer.lipschitz) == pytest.approx(
            float(torch.linalg.matrix_norm(layer.dictionary.detach(), ord=2)) ** 2 + layer.mu, rel=1e-5)
    # evaluation equals training mode's on-the-fly normalisation (which never reads the buffer)
    x = photos()
    with torch.no_grad():
        assert torch.allclose(dst.eval()(x), dst.train()(x), atol=1e-5)
    dst.eval()
    assert refresh_dic(dst) == SMALL["depth"]


def test_checkpoint_loader_accepts_official_style_files(tmp_path: Path) -> None:
    src = unroll.load(NAME, pretrained=False, seed=4, **SMALL)
    x = photos()
    with torch.no_grad():
        want = src(x)
    state = {k: v for k, v in src.state_dict().items() if not k.endswith("lipschitz")}  # L need not be saved
    files = {"model": {"model": {f"module.{k}": v for k, v in state.items()}, "epoch": 3},
             "state_dict": {"state_dict": state}, "bare": state}
    for kind, obj in files.items():
        path = tmp_path / f"{kind}.pth"
        torch.save(obj, path)
        got = unroll.load(NAME, pretrained=False, checkpoint=path, **SMALL)
        with torch.no_grad():
            assert torch.allclose(got(x), want, atol=1e-6), kind
    wrong = unroll.load(NAME, pretrained=False, **{**SMALL, "depth": 1})
    with pytest.raises(ValueError, match="unexpected keys"):
        load_checkpoint(wrong, tmp_path / "bare.pth")


@pytest.mark.slow  # the full-size graph (all weights inside) is traced, slimmed, checked and verified
def test_full_size_export_matches_pytorch(exported, model: DicViT) -> None:
    res = exported.res
    rep = res.report
    assert rep["weights"] == "seeded random init" and rep["trt_lint"]["ok"]
    assert len(rep["solvers"]) == 7 and all(s["solver"] == "ISTA (elastic net)" for s in rep["solvers"])
    for c in rep["parity"]["cases"]:
        assert c["max_abs_err"] <= 1e-4 and c["rel_err"] <= 1e-5, c
    assert max(c["batch"] for c in rep["parity"]["cases"]) > 1
    graph = onnx.load(res.onnx_path)
    ops = {n.op_type for n in graph.graph.node}
    assert not ops & set(SUSPECT_OPS) and not ops & FORBIDDEN_OPS, ops
    assert rep["op_histogram"]["Clip"] == 7 * model.blocks[0].attn.n_steps
    assert [i.name for i in graph.graph.input] == ["image"] and [o.name for o in graph.graph.output] == ["logits"]
    # independently: the photos at CIFAR size through ONNX Runtime vs the same seeded model in PyTorch
    x = photos()
    sess = ort.InferenceSession(str(res.onnx_path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"image": x.numpy()})[0]
    with torch.no_grad():
        want = model(x).double().numpy()
    assert rel_err(got, want) <= 1e-4 and np.array_equal(got.argmax(1), want.argmax(1))


# --- served: repository → tritonserver → gateway -------------------------------------------------------------------


@pytest.mark.triton
@pytest.mark.slow
def test_served_through_triton_and_gateway_like_pytorch(exported, model: DicViT, tmp_path: Path) -> None:
    from unroll.card import from_onnx
    from unroll.serving.imaging import images
    from unroll.serving.repository import write_repository

    repo = tmp_path / "repo"
    write_repository("cpu", [NAME], repo, onnx_dir=exported.dir)
    card = from_onnx(repo / NAME / "1" / "model.onnx")
    assert card.labels == get_spec(NAME).card.labels and card.input.resize == "stretch"
    uploads = []
    for name, img in zip(data.PHOTOS[:3], photos(), strict=False):  # at the native 32×32: the input is pixels / 255
        arr = np.rint(img.numpy().transpose(1, 2, 0) * 255).astype(np.uint8)
        uploads.append((name, png(arr), arr.transpose(2, 0, 1)[None].astype(np.float32) / 255.0))
    big = data.bundled_image("coffee", gray=False)[..., :3]  # one the card stretches (400×600 → 32×32)
    raw = png(big)
    uploads.append(("coffee 400×600", raw, images.classifier_input(images.decode(raw, 10**7), card.input).x))
    with gateway_over_triton(repo, tmp_path) as client:
        served = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
        assert served[NAME]["task"] == "classification"
        tops = set()
        for label, body, x in uploads:
            with torch.no_grad():
                probs = softmax(model(torch.from_numpy(x)).double()[0].numpy())
            r = client.post("/v1/classify", params={"model": NAME, "top_k": 5},
                            files={"image": (f"{label}.png", body, "image/png")})
            assert r.status_code == 200, (label, r.text)
            check_topk(r.json(), probs, 5, card.labels)
            tops.add(round(r.json()["predictions"][0]["score"], 6))
        assert len(tops) > 1  # different photos, different answers: the served graph looks at the image
        r = client.post("/v1/classify", params={"model": NAME, "top_k": 11},
                        files={"image": ("x.png", uploads[0][1], "image/png")})
        assert r.status_code == 422 and "10 classes" in r.json()["error"]["message"]
