"""The solver's residual served (issue 40): the exported graph's extra outputs are PyTorch's residual and code size,
the card carries the rule `unroll bench ood` chose on validation data, and the gateway answers each classification
with ``ood_score`` / ``in_distribution`` (and ``X-In-Distribution``), ``abstain=true`` withholding the labels of an
out-of-distribution image; Triton-direct clients get the signals themselves. A real tritonserver and gateway."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from served import png
from skimage import data as skdata

import unroll
from unroll import registry
from unroll.card import SOLVER_SIGNALS, CardError, ModelCard, OodCard, OodTerm, from_onnx
from unroll.data import mnist_split
from unroll.export.onnx_export import calibrated_ood
from unroll.serving.gateway import ood
from unroll.serving.imaging import images
from unroll.solvers.residual import WithResidual

MODEL = "sdnet-mnist"
PHOTOS = ("astronaut", "chelsea", "coffee")  # the three photos, all "8" at ≥ 0.996 without the score


def _recorded_rule() -> dict:
    return registry.get_spec(MODEL).info()["ood"]


def test_the_registration_declares_ood_and_the_export_carries_the_recorded_rule(demo_onnx_dir: Path) -> None:
    declared = registry.get_spec(MODEL).card.ood
    assert declared == OodCard() and not declared.calibrated  # the numbers live in the training record only
    card = from_onnx(demo_onnx_dir / f"{MODEL}.onnx")
    assert card.ood == OodCard(**_recorded_rule()) and card.ood.calibrated
    assert card.output_names == ["logits", "solver_fit"]
    sess = ort.InferenceSession(str(demo_onnx_dir / f"{MODEL}.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == ["logits", "solver_fit"]
    # the other iteration counts' graphs carry no rule (it holds at the trained count) and no residual output
    sibling = from_onnx(demo_onnx_dir / f"{MODEL}-iters4.onnx")
    assert sibling.ood is None and sibling.output_names == ["logits"]
    report = json.loads((demo_onnx_dir / f"{MODEL}.report.json").read_text())
    for case in report["parity"]["cases"]:
        assert [o["ok"] for o in case["outputs"]] == [True, True], case


def test_the_rule_is_filled_in_only_where_the_card_declares_ood_and_gives_none() -> None:
    declared = registry.get_spec(MODEL).card
    rule = _recorded_rule()
    assert calibrated_ood(declared, rule).ood == OodCard(**rule)
    assert calibrated_ood(declared, None) == declared  # no record (or another checkpoint's weights): no rule
    given = declared.model_copy(update={"ood": OodCard(terms=(OodTerm(signal="residual", sided="high"),),
                                                        threshold=0.9)})
    assert calibrated_ood(given, rule) == given  # the card's own rule stands
    plain = declared.model_copy(update={"ood": None})
    assert calibrated_ood(plain, rule) == plain
    with pytest.raises(CardError, match="ood rule is invalid"):
        calibrated_ood(declared, {**rule, "terms": [{**rule["terms"][0], "scale": -1.0}]})


def _fitted(img: np.ndarray) -> np.ndarray:
    card = registry.get_spec(MODEL).card
    return images.classifier_input(Image.fromarray(img), card.input, "auto").x


def test_the_solver_outputs_are_pytorchs_within_1e_5(demo_onnx_dir: Path) -> None:
    _, _, x, _ = mnist_split()
    photos = np.concatenate([_fitted(getattr(skdata, p)()) for p in PHOTOS])
    batch = np.concatenate([x[:61], photos]).astype(np.float32)
    lam = np.full(len(batch), from_onnx(demo_onnx_dir / f"{MODEL}.onnx").lam.default, np.float32)
    sess = ort.InferenceSession(str(demo_onnx_dir / f"{MODEL}.onnx"), providers=["CPUExecutionProvider"])
    logits, fit = sess.run(None, {"image": batch, "lam": lam})
    with torch.no_grad():
        wants = WithResidual(unroll.load(MODEL).eval())(torch.from_numpy(batch), torch.from_numpy(lam))
    want_logits, want = (w.numpy() for w in wants)
    for column in range(2):  # the residual, the code's size: each within 1e-5 relative
        got, w = fit[:, column], want[:, column]
        assert np.linalg.norm(got - w) / np.linalg.norm(w) <= 1e-5
    np.testing.assert_allclose(logits, want_logits, atol=1e-4)


def test_fields_say_why_there_is_no_score(demo_onnx_dir: Path) -> None:
    served = from_onnx(demo_onnx_dir / f"{MODEL}.onnx")
    lam = served.lam.default
    medians = {t.signal: t.center for t in served.ood.terms}  # the validation digits' median of every signal
    r = {"solver_fit": np.array([[medians.get(s, 0.0) for s in SOLVER_SIGNALS]])}
    assert ood.fields(served, served, lam, r, medians.get("msp", 0.0)) == {"ood_score": 0.0, "in_distribution": True}
    plain = served.model_copy(update={"ood": None})
    assert "no solver residual" in ood.fields(plain, plain, lam, {}, 0.0)["ood_note"]
    declared = served.model_copy(update={"ood": OodCard()})
    assert "no rule" in ood.fields(declared, declared, lam, r, 0.0)["ood_note"]
    nan = ood.fields(served, served, lam, {"solver_fit": np.array([[np.nan, 1.0]], np.float32)}, 0.0)
    assert nan["in_distribution"] is None and "not a finite number" in nan["ood_note"]
    assert ood.header({"in_distribution": None}) == "unknown" and ood.header({"in_distribution": False}) == "false"


def test_the_card_refuses_ood_where_it_cannot_hold() -> None:
    den = registry.get_spec("csc-denoiser").card
    with pytest.raises(CardError, match="classifiers"):
        ModelCard.from_json(json.dumps({**json.loads(den.to_json()), "ood": {}}))
    clf = json.loads(registry.get_spec(MODEL).card.to_json())
    for taken in ("lam", "logits", "image"):
        with pytest.raises(CardError, match="names another tensor"):
            ModelCard.from_json(json.dumps({**clf, "ood": {"output": taken}}))


# --- served: the session's tritonserver and a gateway ---------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(demo_gateway: httpx.Client) -> httpx.Client:
    """The session's gateway and tritonserver (the demo models)."""
    return demo_gateway


def classify(client: httpx.Client, data: bytes, query: str = "") -> httpx.Response:
    r = client.post(f"/v1/classify?model={MODEL}&top_k=1{query}", content=data, headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    return r


@pytest.mark.triton
def test_the_three_photos_are_out_of_distribution_and_abstain_withholds_their_label(gateway: httpx.Client) -> None:
    for name in PHOTOS:
        data = png(getattr(skdata, name)())
        body = classify(gateway, data).json()
        assert body["in_distribution"] is False and body["ood_score"] > OodCard(**_recorded_rule()).threshold, body
        assert body["predictions"][0]["score"] > 0.99  # the softmax alone is certain: the complaint
        r = classify(gateway, data, "&abstain=true")
        assert r.headers[ood.HEADER] == "false"
        assert r.json()["predictions"] == [] and r.json()["abstained"] is True


@pytest.mark.triton
def test_clean_test_digits_are_in_distribution_with_the_in_process_scores(gateway: httpx.Client) -> None:
    """200 clean test digits: the served scores are the rule applied to PyTorch's signals, and few are flagged."""
    _, _, x, _ = mnist_split()
    digits = [(x[i, 0] * 255).round().astype(np.uint8) for i in range(200)]
    rule = OodCard(**_recorded_rule())
    model = unroll.load(MODEL).eval()
    fitted = torch.from_numpy(np.concatenate([_fitted(d) for d in digits]))
    with torch.no_grad():
        logits, fit = WithResidual(model)(fitted)
    msp = 1.0 - torch.softmax(logits.double(), 1).amax(1)
    want = rule.score({**dict(zip(SOLVER_SIGNALS, fit.double().numpy().T, strict=True)), "msp": msp.numpy()})
    answers = [classify(gateway, png(d), "&abstain=true") for d in digits]
    got = [a.json()["ood_score"] for a in answers]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    flagged = [a.json()["in_distribution"] is False for a in answers]
    assert sum(flagged) <= 0.05 * len(digits), sum(flagged)  # ood.md: 1 % of validation digits, a few more on test
    assert all(a.headers[ood.HEADER] == "true" and a.json()["predictions"] for a, f in zip(answers, flagged,
                                                                                            strict=True) if not f)


@pytest.mark.triton
@pytest.mark.parametrize("query, why", [("&lam=0.3", "trained λ"), ("&lam=auto", "trained λ"),
                                        ("&iters=4", "trained iteration count")])
def test_another_lambda_or_count_gets_no_verdict_and_says_why(gateway: httpx.Client, query: str, why: str) -> None:
    r = classify(gateway, png(skdata.astronaut()), query + "&abstain=true")
    body = r.json()
    assert body["ood_score"] is None and body["in_distribution"] is None and why in body["ood_note"], body
    assert r.headers[ood.HEADER] == "unknown" and body["predictions"]  # no verdict: nothing withheld


@pytest.mark.triton
def test_triton_direct_clients_get_the_signals_the_gateway_scores(demo_triton, gateway: httpx.Client) -> None:
    import tritonclient.http as httpclient

    from unroll.serving.imaging import wire

    data = png(skdata.coffee())
    with httpclient.InferenceServerClient(demo_triton.url) as client:
        raw = np.frombuffer(data, np.uint8).reshape(1, -1)
        inp = httpclient.InferInput(wire.IMAGE_BYTES, list(raw.shape), "UINT8")
        inp.set_data_from_numpy(raw)
        res = client.infer(MODEL, [inp], outputs=[httpclient.InferRequestedOutput(o) for o in ("logits", "solver_fit")])
    logits = res.as_numpy("logits").reshape(-1).astype(np.float64)
    p = np.exp(logits - logits.max())
    signals = dict(zip(SOLVER_SIGNALS, res.as_numpy("solver_fit").reshape(-1).tolist(), strict=True))
    score = OodCard(**_recorded_rule()).score({**signals, "msp": 1.0 - p.max() / p.sum()})
    assert score == pytest.approx(classify(gateway, data).json()["ood_score"], abs=1e-4)


@pytest.mark.triton
def test_a_float_request_gets_the_outputs_it_names_and_every_one_when_it_names_none(demo_triton) -> None:
    """A client that asks for the logits alone gets them alone, the same numbers; one that names none gets every
    output (``image_info`` too). (Triton drops an output nobody asked for either way: that the backend no longer
    builds it shows in ``unroll bench ood``'s *score not asked* row, not here.)"""
    import tritonclient.http as httpclient

    x = mnist_split()[2][:3]
    with httpclient.InferenceServerClient(demo_triton.url) as client:
        inp = httpclient.InferInput(registry.get_spec(MODEL).card.input.name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        alone = client.infer(MODEL, [inp], outputs=[httpclient.InferRequestedOutput("logits")])
        every = client.infer(MODEL, [inp])
    assert [o["name"] for o in alone.get_response()["outputs"]] == ["logits"]
    assert sorted(o["name"] for o in every.get_response()["outputs"]) == ["image_info", "logits", "solver_fit"]
    np.testing.assert_array_equal(alone.as_numpy("logits"), every.as_numpy("logits"))
    assert every.as_numpy("solver_fit").shape == (3, len(SOLVER_SIGNALS))


@pytest.mark.triton
def test_the_denoisers_discrepancy_is_read_from_what_the_gateway_answers(gateway: httpx.Client) -> None:
    """The denoiser's out-of-distribution signal needs nothing new served: for one test image of each kind, the
    gateway's ``X-Sigma-Used`` and ``X-Sigma-Residual`` are the benchmark's in-process numbers."""
    from unroll.benchmarks import denoise_ood, denoise_residual

    card = registry.get_spec("csc-denoiser").card
    model = registry.load("csc-denoiser").eval()
    for kind, sent in denoise_ood.requests("test", card, crops=1).items():
        r = gateway.post("/v1/denoise?model=csc-denoiser", content=sent[0],
                         headers={"Content-Type": "image/jpeg" if sent[0][:2] == b"\xff\xd8" else "image/png"})
        assert r.status_code == 200, (kind, r.text)
        bench = denoise_residual.estimates(model, card, sent[0])
        assert float(r.headers["X-Sigma-Used"]) == pytest.approx(bench["sigma"], abs=1e-3), kind
        assert float(r.headers["X-Sigma-Residual"]) == pytest.approx(bench["residual"], rel=0.01, abs=0.05), kind


@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_unroll_serve_of_an_int8_choice_answers_by_the_int8_graphs_own_rule(demo_onnx_dir: Path,
                                                                           tmp_path: Path) -> None:
    """`unroll optimize sdnet-mnist --precision fp32,fp16,int8` chose INT8 on OpenVINO (the committed record); with
    that choice `unroll serve` (its supervisor, two gateway workers, spare ports) builds the INT8 graph and serves the
    rule measured on it: ``/v1/models`` shows it, and the verdicts and scores are that rule's, not the FP32 one's."""
    import shutil

    import onnx

    from unroll import artifacts
    from unroll.benchmarks.common import RESULTS
    from unroll.benchmarks.soak import start_serve, stop_serve

    root = tmp_path.resolve()
    shutil.copytree(demo_onnx_dir, root / "onnx")
    chosen = root / "optimize"
    chosen.mkdir()
    published = RESULTS / f"optimize_{MODEL}.cpu.json"
    record = json.loads(published.read_text())
    assert record["choice"]["precision"] == "int8" and record["choice"]["runtime"] == "openvino", record["choice"]
    (chosen / f"{MODEL}.cpu.json").write_text(published.read_text())
    s = start_serve(root, [MODEL], log=lambda m: None, settings={"UNROLL_OPTIMIZE_DIR": str(chosen)},
                    args=("--workers", "2"), ready_timeout_s=600)
    try:
        int8 = from_onnx(onnx.load(str(artifacts.graph(MODEL, "int8", onnx_dir=root / "onnx")))).ood
        fp32 = OodCard(**_recorded_rule())
        assert int8 is not None and int8.measured_on == "int8" and int8.threshold != fp32.threshold
        with httpx.Client(base_url=s.base, timeout=60) as client:
            [listed] = [m for m in client.get("/v1/models").json()["models"] if m["name"] == MODEL]
            assert listed["runtime"] == "openvino", listed
            assert OodCard(**listed["card"]["ood"]) == int8, listed["card"]["ood"]
            for name in PHOTOS:
                r = classify(client, png(getattr(skdata, name)()), "&abstain=true")
                assert r.json()["in_distribution"] is False and r.headers[ood.HEADER] == "false", r.json()
                assert r.json()["ood_score"] > int8.threshold
            _, _, x, _ = mnist_split()
            answers = [classify(client, png((x[i, 0] * 255).round().astype(np.uint8))).json() for i in range(40)]
            assert sum(a["in_distribution"] is False for a in answers) <= 2, answers  # ood.md: INT8 flags ~1 %
            assert all((a["ood_score"] > int8.threshold) is (a["in_distribution"] is False) for a in answers)
    finally:
        stop_serve(s)
