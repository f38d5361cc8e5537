"""PNG plots for the benchmark results (matplotlib, Agg: no display needed).

Each function takes a benchmark's payload (the same dict that goes to JSON) and an output folder,
writes its PNG(s) and returns the paths. ``matplotlib.figure.Figure`` is used directly, without
pyplot, so nothing global (backend, open figures) is touched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

DPI = 110
PATH_COLORS = {"onnxruntime": "tab:green", "triton-http": "tab:blue", "triton-grpc": "tab:purple",
               "triton-grpc-image": "tab:brown", "gateway": "tab:red"}
PATH_LABELS = {"onnxruntime": "in-process ONNX Runtime", "triton-http": "Triton HTTP", "triton-grpc": "Triton gRPC",
               "triton-grpc-image": "Triton gRPC, PNG bytes", "gateway": "gateway"}
LAYERS = (("queue_ms", "Triton queue", "tab:orange"), ("compute_input_ms", "compute input", "tab:olive"),
          ("compute_infer_ms", "infer", "tab:blue"), ("compute_output_ms", "compute output", "tab:cyan"),
          ("other_ms", "other (server)", "tab:gray"))


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def _levels_axis(ax, levels: list[int], log_y: bool = False) -> None:
    """Concurrency on a log2 x axis labelled with the measured levels; plain numbers on a log y axis."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(levels)) or [1]))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=6)


def _grid(n: int, width: float = 5.0, height: float = 3.8) -> tuple[Figure, list]:
    fig = Figure(figsize=(width * n, height))
    axes = [fig.add_subplot(1, n, i + 1) for i in range(n)]
    return fig, axes


# ----------------------------------------------------------------------------------------------- serve


def serve_plots(payload: dict, out_dir: Path) -> list[Path]:
    """``serve_latency.png``, ``serve_throughput.png`` and ``serve_split.png``."""
    runs = payload["runs"]
    workloads = [k for k in payload["config"]["workloads"] if any(r["workload"] == k for r in runs)]
    labels = {k: f"{v['model']}: {v['input']}" for k, v in payload["config"]["workloads"].items()}
    return [_serve_latency(runs, workloads, labels, out_dir),
            _serve_throughput(payload, runs, workloads, labels, out_dir),
            _serve_split(runs, workloads, labels, out_dir)]


def _serve_latency(runs: list[dict], workloads: list[str], labels: dict[str, str], out_dir: Path) -> Path:
    fig, axes = _grid(len(workloads))
    for ax, key in zip(axes, workloads, strict=True):
        for path, color in PATH_COLORS.items():
            rs = sorted((r for r in runs if r["workload"] == key and r["path"] == path and r["requests"]),
                        key=lambda r: r["concurrency"])
            if not rs:
                continue
            c = [r["concurrency"] for r in rs]
            ax.plot(c, [r["latency_ms"]["p50"] for r in rs], "o-", color=color, label=f"{PATH_LABELS[path]} p50")
            ax.plot(c, [r["latency_ms"]["p99"] for r in rs], "s--", color=color, alpha=0.7,
                    label=f"{PATH_LABELS[path]} p99")
            ax.fill_between(c, [r["latency_ms"]["p90"] for r in rs], [r["latency_ms"]["p95"] for r in rs],
                            color=color, alpha=0.12)
        _levels_axis(ax, [r["concurrency"] for r in runs if r["workload"] == key], log_y=True)
        ax.set_xlabel("in-flight requests")
        ax.set_ylabel("latency (ms)")
        ax.set_title(labels[key], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Client latency vs concurrency (p50 solid, p99 dashed, p90–p95 shaded)", fontsize=10)
    return _save(fig, out_dir / "serve_latency.png")


def _serve_throughput(payload: dict, runs: list[dict], workloads: list[str], labels: dict[str, str],
                      out_dir: Path) -> Path:
    b = payload.get("batching")
    fig, axes = _grid(len(workloads) + (1 if b else 0), width=4.6)
    for ax, key in zip(axes, workloads, strict=False):
        for path, color in PATH_COLORS.items():
            rs = sorted((r for r in runs if r["workload"] == key and r["path"] == path),
                        key=lambda r: r["concurrency"])
            if rs:
                ax.plot([r["concurrency"] for r in rs], [r["throughput_rps"] for r in rs], "o-", color=color,
                        label=PATH_LABELS[path])
        _levels_axis(ax, [r["concurrency"] for r in runs if r["workload"] == key])
        ax.set_xlabel("in-flight requests")
        ax.set_ylabel("requests / s")
        ax.set_title(labels[key], fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    if b:
        ax = axes[-1]
        vals = [b["on"]["throughput_rps"], b["off"]["throughput_rps"]]
        bars = ax.bar(["batching on", "batching off\n(max_batch_size 1)"], vals, color=["tab:purple", "tab:gray"])
        ax.bar_label(bars, fmt="%.0f")
        ax.margins(y=0.15)
        ax.set_ylabel("requests / s")
        sp = b.get("speedup")
        n = len(b["rounds"])
        ax.set_title(f"{b.get('model', 'classifier')}, gRPC, {b['concurrency']} in flight: "
                     + (f"{sp:.2f}×" if sp else "-") + (f" (median of {n} rounds)" if n > 1 else ""), fontsize=9)
    fig.suptitle("Throughput vs concurrency", fontsize=10)
    return _save(fig, out_dir / "serve_throughput.png")


def _serve_split(runs: list[dict], workloads: list[str], labels: dict[str, str], out_dir: Path) -> Path:
    key = workloads[0]  # the classifier's workload comes first (serve_bench); its server split is shown
    server_paths = [p for p in ("triton-http", "triton-grpc", "gateway")
                    if any(r["workload"] == key and r["path"] == p for r in runs)]
    fig, axes = _grid(max(1, len(server_paths)), width=4.6)
    ort_runs = {r["concurrency"]: r for r in runs
                if r["workload"] == key and r["path"] == "onnxruntime" and r["requests"]}
    for ax, path in zip(axes, server_paths, strict=False):
        rs = sorted((r for r in runs if r["workload"] == key and r["path"] == path and r["requests"]),
                    key=lambda r: r["concurrency"])
        x = np.arange(len(rs))
        bottom = np.zeros(len(rs))
        for field, name, color in LAYERS:
            v = np.array([(r["server"] or {}).get(field) or 0.0 for r in rs])
            ax.bar(x, v, bottom=bottom, color=color, label=name)
            bottom += v
        outside = np.array([max(0.0, r["latency_ms"]["mean"] - ((r["server"] or {}).get("total_ms") or 0.0))
                            for r in rs])
        ax.bar(x, outside, bottom=bottom, color="tab:red" if path == "gateway" else "tab:pink",
               label="gateway + client + network" if path == "gateway" else "client + network")
        ref = [ort_runs[r["concurrency"]]["latency_ms"]["mean"] if r["concurrency"] in ort_runs else np.nan
               for r in rs]
        ax.plot(x, ref, "k_", markersize=18, mew=2, label="in-process ONNX Runtime")
        ax.set_xticks(x, [str(r["concurrency"]) for r in rs])
        ax.set_xlabel("in-flight requests")
        ax.set_ylabel("mean latency (ms)")
        ax.set_title(PATH_LABELS[path], fontsize=9)
        ax.legend(fontsize=6)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Where the time goes ({labels[key]}): Triton statistics + the rest, mean per request",
                 fontsize=10)
    return _save(fig, out_dir / "serve_split.png")


# ----------------------------------------------------------------------------------------------- models


def models_plots(payload: dict, out_dir: Path) -> list[Path]:
    """``models_scaling.png``: denoiser latency vs pixels (log-log, fitted exponent); classifier throughput vs batch."""
    fig, (a1, a2) = _grid(2, width=5.2)
    sc = payload.get("scaling", {})
    denoiser = "denoiser"
    for engine, d in sc.get("denoiser", {}).items():
        denoiser = d.get("model", denoiser)
        px = np.array([p["pixels"] for p in d["points"]], dtype=float)
        ms = np.array([p["median_ms"] for p in d["points"]])
        line = a1.loglog(px, ms, "o", label=f"{engine}: exponent {d['fit']['exponent']:.2f}")[0]
        xx = np.geomspace(px.min(), px.max(), 50)
        a1.loglog(xx, np.exp(d["fit"]["log_coef"]) * xx ** d["fit"]["exponent"], "-", color=line.get_color(),
                  alpha=0.6)
        for p in d["points"]:
            a1.annotate(f"{p['side']}²", (p["pixels"], p["median_ms"]), fontsize=7, xytext=(3, -8),
                        textcoords="offset points")
    a1.set_xlabel("pixels (H×W)")
    a1.set_ylabel("median latency (ms)")
    a1.set_title(f"{denoiser} latency vs image size (fit: ms ∝ pixels^k)", fontsize=9)
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=7)
    for engine, pts in sc.get("classifier", {}).get("engines", {}).items():
        a2.plot([p["batch"] for p in pts], [p["images_per_s"] for p in pts], "o-", label=engine)
    _levels_axis(a2, [p["batch"] for pts in sc.get("classifier", {}).get("engines", {}).values() for p in pts])
    a2.set_xlabel("batch size")
    a2.set_ylabel("images / s")
    a2.set_title(f"{sc.get('classifier', {}).get('model', 'classifier')} throughput vs batch size", fontsize=9)
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=7)
    a2.set_ylim(bottom=0)
    return [_save(fig, out_dir / "models_scaling.png")]


# ----------------------------------------------------------------------------------------------- quality


def quality_denoise_plot(payload: dict, out_dir: Path) -> Path:
    """``quality_denoise.png``: mean PSNR per method and σ (bars) and wall time per image (log)."""
    methods = payload["methods"]
    sigmas = payload["sigmas"]
    fig, (a1, a2) = _grid(2, width=6.0)
    width = 0.8 / max(1, len(methods))
    x = np.arange(len(sigmas))
    for i, m in enumerate(methods):
        v = [payload["summary"][m][f"{s:g}"]["psnr"] for s in sigmas]
        a1.bar(x + (i - (len(methods) - 1) / 2) * width, v, width, label=m)
    a1.set_xticks(x, [f"σ = {s:g}" for s in sigmas])
    a1.set_ylabel("mean PSNR (dB)")
    vals = [payload["summary"][m][f"{s:g}"]["psnr"] for m in methods for s in sigmas]
    lo, hi = max(0.0, min(vals) - 3), max(vals)
    a1.set_ylim(lo, hi + 0.45 * (hi - lo))  # headroom for the legend
    a1.set_title(f"PSNR on {payload['n_images']} held-out images (same noisy inputs)", fontsize=9)
    a1.legend(fontsize=7, ncol=3, loc="upper right")
    a1.grid(True, axis="y", alpha=0.3)
    t = [payload["time_s"][m]["mean"] for m in methods]
    bars = a2.barh(methods, t, color="tab:gray")
    a2.bar_label(bars, fmt="%.3g s", fontsize=7)
    a2.set_xscale("log")
    a2.set_xlim(min(t) / 2, max(t) * 5)  # room for the labels
    a2.set_xlabel("mean wall time per image (s)")
    a2.set_title("Speed (one image, 2 threads where the method threads)", fontsize=9)
    a2.invert_yaxis()
    return _save(fig, out_dir / "quality_denoise.png")


def quality_classify_plot(payload: dict, out_dir: Path) -> Path:
    """``quality_classify.png``: accuracy vs noise σ per precision, λ fixed (solid) vs auto (dashed)."""
    fig, (ax,) = _grid(1, width=6.5, height=4.2)
    colors = {"fp32": "tab:blue", "fp16": "tab:orange", "int8": "tab:green", "pytorch (record)": "black"}
    for prec, d in payload["results"].items():
        c = colors.get(prec)
        s = [r["sigma"] for r in d]
        ax.plot(s, [100 * r["acc_fixed"] for r in d], "o-", color=c, label=f"{prec}, λ fixed")
        if all(r.get("acc_auto") is not None for r in d):
            ax.plot(s, [100 * r["acc_auto"] for r in d], "s--", color=c, label=f"{prec}, λ auto")
    ax.set_xlabel("Gaussian noise σ (pixel scale 0–1)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{payload.get('model', 'classifier')} on {payload['n_digits']} held-out samples", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out_dir / "quality_classify.png")


def robustness_plot(payload: dict, out_dir: Path) -> Path:
    """``robustness.png``: per corruption, accuracy vs severity (0 = clean) for each model at its trained λ (solid),
    at the validation-chosen λ (dashed) and with its λ rule (dotted); the legend in a panel of its own."""
    corruptions = list(payload["corruptions"])
    cols = 4
    rows = -(-(len(corruptions) + 1) // cols)  # one more panel: the legend
    fig = Figure(figsize=(3.2 * cols, 2.6 * rows))
    styles = (("trained", "-", "trained λ"), ("chosen", "--", "λ chosen on validation"), ("auto", ":", "λ rule"))
    handles: dict = {}
    for k, c in enumerate(corruptions):
        ax = fig.add_subplot(rows, cols, k + 1)
        for i, (name, m) in enumerate(payload["models"].items()):
            sev = [r for r in m["rows"] if r["corruption"] == c]
            for key, ls, label in styles:
                if all(key in r for r in sev):
                    (line,) = ax.plot([0] + [r["severity"] for r in sev],
                                      [100 * m["clean"]] + [100 * r[key] for r in sev],
                                      ls, marker="o", ms=3, color=f"C{i % 10}")
                    handles.setdefault(name if m.get("trained_lam") is None else f"{name}, {label}", line)
        ax.set_title(c, fontsize=8)
        ax.set_xticks([0, *payload["severities"]])
        ax.set_ylim(0, 102)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=7)
        if k % cols == 0:
            ax.set_ylabel("accuracy (%)", fontsize=8)
        if k >= len(corruptions) - cols:
            ax.set_xlabel("severity (0 = clean)", fontsize=8)
    legend = fig.add_subplot(rows, cols, len(corruptions) + 1)
    legend.axis("off")
    legend.legend(list(handles.values()), list(handles), fontsize=6, loc="center", frameon=False,
                  ncol=1 if len(handles) <= 12 else 2)
    return _save(fig, out_dir / "robustness.png")


def robustness_lam_plot(payload: dict, out_dir: Path) -> Path | None:
    """``robustness_lam.png``: per model that takes λ, test accuracy vs λ (log axis) clean, at each severity of
    Gaussian noise and averaged over every corruption; a star marks the λ chosen on the validation digits, an open
    circle the oracle on the test digits, the dotted line the trained λ. ``None`` (nothing drawn) when no model
    takes λ."""
    models = {n: m for n, m in payload["models"].items() if "lam_curve" in m}
    if not models:
        return None
    cols = min(3, len(models))
    rows = -(-len(models) // cols)
    fig = Figure(figsize=(4.6 * cols, 3.4 * rows))
    grid = payload["lam_grid"]
    for k, (name, m) in enumerate(models.items()):
        ax = fig.add_subplot(rows, cols, k + 1)
        lc = m["lam_curve"]
        for i, c in enumerate(lc["conditions"]):
            mean = c["condition"].startswith("mean")
            color = "black" if mean else f"C{i}"
            ax.plot(grid, [100 * v for v in c["test"]], "--" if mean else "-", marker="o", ms=3, color=color,
                    lw=2 if mean else 1.2, label=c["condition"])
            ax.plot([c["chosen_lam"]], [100 * c["chosen"]], "*", ms=11, color=color, mec="white", mew=0.5)
            ax.plot([c["oracle_lam"]], [100 * c["oracle"]], "o", ms=9, mfc="none", mec=color)
        ax.axvline(lc["trained_lam"], color="gray", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_xticks(grid, labels=[f"{v:g}" for v in grid])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.tick_params(labelsize=7)
        ax.set_ylim(0, 102)
        ax.set_xlabel("λ (one for every digit; dotted: trained)", fontsize=8)
        ax.set_ylabel("test accuracy (%)", fontsize=8)
        ax.set_title(f"{name}: ★ chosen on validation, ○ oracle on test", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="lower left")
    return _save(fig, out_dir / "robustness_lam.png")


# ----------------------------------------------------------------------------------------------- iterations


def iterations_plot(payload: dict, out_dir: Path) -> Path:
    """``iterations.png``: per model, clean and mean-corrupted accuracy against gateway p50 latency, one point per
    served iteration count (labelled K; the trained count ringed)."""
    fig, axes = _grid(2, width=5.5)
    for ax, key, title in zip(axes, ("clean", "mean_corrupted"), ("clean test digits", "mean over corruptions"),
                              strict=True):
        for name, m in payload["models"].items():
            rows = m["counts"]
            lat = [r["latency_ms"]["p50"] for r in rows]
            acc = [100 * r[key] for r in rows]
            (line,) = ax.plot(lat, acc, marker="o", label=name)
            for r, xv, yv in zip(rows, lat, acc, strict=True):
                ax.annotate(f"K={r['iters']}", (xv, yv), textcoords="offset points", xytext=(4, 4), fontsize=7)
                if r["iters"] == m["trained"]:
                    ax.plot([xv], [yv], marker="o", markersize=12, fillstyle="none", color=line.get_color())
        ax.set_xlabel("gateway p50 latency (ms), concurrency 1")
        ax.set_ylabel("top-1 accuracy (%)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, out_dir / "iterations.png")
