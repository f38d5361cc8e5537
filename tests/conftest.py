"""Shared test set-up: deterministic, 2 threads (the CI machine's cores), the session's shared servers, and the
test tiers.

Two tiers: ``full`` (what ``make test`` and CI run: every test) and ``check`` (``make check``: the contributor's
inner loop, a few minutes). Every test is ``check`` unless :data:`FULL` makes it ``full``, and the reason goes into
its marker: ``pytest.mark.full("kills tritonserver mid-request")``. The decisions live in one table here, not in
``pytestmark`` lines spread over the files, so that (1) a reader sees every tier decision and its reason in one place,
and so what the inner loop leaves out; (2) a file is tiered without editing it (several people edit tests at once);
(3) tests/test_tiers.py holds the rules against one structure: every test file has a decision, every ``full`` entry a
one-line reason and a test it names, every ``slow`` test is ``full``, no file writes a tier marker of its own, and the
``check`` tier imports every package.
"""

import json
import os
import resource
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

# `unroll optimize`'s choices change what `unroll repo` writes: the tests (and the servers they start) read an empty
# folder instead of this checkout's build/optimize (set before anything imports unroll.artifacts)
os.environ["UNROLL_OPTIMIZE_DIR"] = tempfile.mkdtemp(prefix="unroll-test-optimize-")
# make test runs several test processes on few cores, each starting servers and subprocesses: OpenMP threads that
# spin while they wait would burn the cores the others need (inherited by every process a test starts)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from served import gateway_over, shared_triton

from unroll.serving.triton import TritonHandle

# --------------------------------------------------------------------------------------------------- test tiers
# (the module docstring says why one table)

#: Test files whose tests are all ``check``, except those named in :data:`FULL` as ``FILE::TEST``.
CHECK_FILES = frozenset({
    "test_access_log.py", "test_anytime_pilot.py", "test_architecture.py", "test_batch_rows.py", "test_batching.py",
    "test_benchmarks.py",
    "test_cancel.py", "test_cli_help.py", "test_corruptions.py", "test_csc_golden.py", "test_csc_optimality.py",
    "test_dashboard.py", "test_data.py", "test_denoise_contract.py", "test_denoiser_graph.py",
    "test_deploy_manifests.py", "test_dic_vit.py", "test_digit_models.py", "test_docs.py", "test_doctor.py",
    "test_errors.py", "test_eval_progress.py", "test_export.py", "test_export_user.py", "test_fuse.py",
    "test_gateway.py", "test_gateway_http.py", "test_gateway_inputs.py", "test_gateway_metric_routes.py",
    "test_gateway_rgb.py", "test_gateway_workers.py", "test_gpu_check.py", "test_gpu_repository.py",
    "test_gpu_serve_check.py", "test_hamburger.py", "test_hidden_args.py", "test_http_refusals.py",
    "test_import_from_parent.py", "test_iterations.py", "test_one_load_engine.py", "test_ood.py", "test_ood_served.py",
    "test_packaging.py",
    "test_paired_latency.py", "test_perf_analyzer.py", "test_pipelining.py", "test_png_level.py",
    "test_precision_stress.py", "test_profile.py", "test_profile_agreement.py", "test_profile_bench.py",
    "test_profile_output.py",
    "test_quality_gates.py",
    "test_quantize.py", "test_rate_limit.py",
    "test_rate_limit_workers.py", "test_registry_cli.py", "test_request_id.py", "test_robustness.py", "test_rvt.py",
    "test_sdnet_arch.py", "test_serve_models.py", "test_sigma_band.py", "test_solvers_attention.py",
    "test_staleness.py", "test_standby.py", "test_stress_patterns.py", "test_tiers.py", "test_tiling.py",
    "test_torch_runtime.py", "test_torch_runtime_gpu_paths.py", "test_tracing.py", "test_triton.py",
    "test_triton_down.py", "test_triton_images.py", "test_trt_build.py", "test_trt_lint.py", "test_v2_introspection.py",
    "test_v2_protocol.py",
    "test_versions.py",
})

#: ``FILE`` (every test in it), ``FILE::TEST`` (one test function, all its parameters) or ``FILE::TEST[PARAMS]`` (one
#: parametrization) → why it is ``full``: why it must own its servers, or what makes it heavy. One line each.
FULL: dict[str, str] = {
    # whole files
    "test_aoti.py": "compiles AOTInductor packages with the C++ compiler (minutes)",
    "test_anytime.py": "loads its own tritonserver, gateways and unroll serve above capacity (latency judged)",
    "test_container.py": "builds the serving image with podman and runs it (minutes)",
    "test_deploy.py": "swaps, canaries and rolls back versions in its own unroll serve under load",
    "test_deploy_onnx_card.py": "runs the README's ONNX-only commands verbatim: fuse, quantize, its own unroll serve",
    "test_deploy_own.py": "exports, fuses and serves a user's module through its own unroll serve",
    "test_fuzz.py": "Schemathesis sends hundreds of generated requests through a gateway of its own",
    "test_memory.py": "measures whole-service memory under 20 maximum-size denoise requests",
    "test_new_model.py": "takes a new architecture through every stage to its own tritonserver and gateway",
    "test_new_task.py": "takes a new task through every stage to its own tritonserver and gateway",
    "test_optimize.py": "sweeps runtimes with perf_analyzer on tritonservers of its own",
    "test_readme_deploy.py": "runs the README's deploy commands verbatim: exports and its own unroll serve",
    "test_readme_rest.py": "runs the README's and docs' REST commands verbatim against its own unroll serve",
    "test_readme_triton_images.py": "runs the README's Triton-direct commands verbatim against its own tritonserver",
    "test_soak.py": "kills tritonserver and backend processes under load for minutes",
    "test_supervisor.py": "kills, hangs and restarts tritonserver under its own unroll serve",
    # single tests
    "test_gateway.py::test_triton_down_then_back": "stops and restarts the file's own tritonserver",
    "test_paired_latency.py::test_pairs_find_the_delay_one_server_adds":
        "times request pairs to find a known 2 ms delay (a measurement)",
    "test_triton.py::test_a_killed_parent_leaves_no_triton_and_no_stub":
        "kills the process that started its own tritonserver",
    "test_triton.py::test_triton_command_serves_until_sigint_and_leaves_no_process":
        "SIGINTs its own unroll triton and waits for every process to end",
    "test_benchmarks.py::test_models_bench_quick": "times every runtime of two models (a benchmark run)",
    "test_benchmarks.py::test_cuda_bench_code_dry_run_on_cpu": "runs the CUDA benchmark's whole code path on the CPU",
    "test_benchmarks.py::test_quality_bench_quick": "measures the quality benchmark on every demo model",
    "test_benchmarks.py::test_serve_bench_quick": "runs the serving benchmark against its own tritonserver and gateway",
    "test_deploy_manifests.py::test_kube_play_two_replicas_survive_one_killed":
        "runs two replicas under podman kube play and kills one",
    "test_dic_vit.py::test_full_size_export_matches_pytorch": "traces and verifies the full-size Dic-ViT graph",
    "test_dic_vit.py::test_served_through_triton_and_gateway_like_pytorch":
        "serves the full-size Dic-ViT on its own tritonserver",
    "test_eval_progress.py::test_eval_reproduces_the_committed_metrics_exactly_with_a_moving_bar":
        "evaluates the committed metrics on whole data splits",
    "test_export.py::test_export_large_architectures": "exports and verifies the ImageNet-size architectures",
    "test_export_user.py::test_cli_checkpoint_export_matches_pytorch_with_that_checkpoint":
        "exports an official-size checkpoint through the CLI",
    "test_export_user.py::test_bad_card_option_is_a_clear_error_before_anything_is_written":
        "runs the export CLI in fresh processes on a large model",
    "test_export_user.py::test_cli_exports_the_plain_pytorch_example_with_its_card":
        "exports the plain-PyTorch example through the CLI and verifies it",
    "test_fuse.py::test_textbook_forms_are_fused": "exports and fuses every textbook form of each solver",
    "test_fuse.py::test_fused_third_party_graph_with_card_is_served": "serves a fused graph on its own tritonserver",
    "test_gateway_rgb.py::test_cifar_checkpoint_classifies_an_rgb_png_like_pytorch":
        "serves CIFAR, ImageNet and colour-denoiser exports on its own tritonserver",
    "test_gateway_rgb.py::test_imagenet_checkpoint_resizes_and_crops_a_jpeg_like_pytorch":
        "serves CIFAR, ImageNet and colour-denoiser exports on its own tritonserver",
    "test_gateway_rgb.py::test_colour_denoiser_takes_rgb_natively":
        "serves CIFAR, ImageNet and colour-denoiser exports on its own tritonserver",
    "test_gateway_workers.py::test_requests_spread_over_workers_and_metrics_add_up":
        "starts a gateway of several worker processes and loads it",
    "test_gateway_workers.py::test_killed_worker_is_replaced_and_counts_survive": "kills a gateway worker process",
    "test_gateway_workers.py::test_sigterm_stops_every_worker": "SIGTERMs a gateway of its own with workers",
    "test_gateway_workers.py::test_serve_with_workers_serves_and_sigterm_stops_workers_and_triton":
        "SIGTERMs its own unroll serve with gateway workers",
    "test_gpu_repository.py::test_gateway_serves_gpu_configs_through_a_cpu_stand_in":
        "serves GPU configs on a tritonserver of its own (a CPU stand-in)",
    "test_gpu_serve_check.py::test_cpu_half_serves_measures_and_stops_through_the_real_tritonserver":
        "runs the GPU serving check's CPU half: its own tritonserver, measured",
    "test_iterations.py::test_bench_iters_measures_each_count_through_the_gateway":
        "runs unroll bench iters (a benchmark run through its own servers)",
    "test_ood.py::test_a_quick_run_writes_consistent_results_and_serves_both_deployments":
        "runs unroll bench ood: a fresh tritonserver and gateway per arm and cycle",
    "test_ood.py::test_the_deployment_without_the_score_serves_the_same_model_without_its_solver_output":
        "starts two tritonservers of its own on two repositories (with and without the score)",
    "test_ood_served.py::test_unroll_serve_of_an_int8_choice_answers_by_the_int8_graphs_own_rule":
        "quantizes to INT8 and starts its own unroll serve",
    "test_perf_analyzer.py::test_real_digits_through_perf_analyzer": "runs perf_analyzer measurements",
    "test_perf_analyzer.py::test_perf_analyzer_validates_outputs_against_onnx_runtime":
        "runs perf_analyzer measurements",
    "test_perf_analyzer.py::test_real_images_through_perf_analyzer": "runs perf_analyzer measurements",
    "test_profile_deploy.py": "fuses a third-party ONNX and profiles it under an unroll serve of its own",
    "test_profile_agreement.py::test_perf_analyzer_and_the_engine_both_drive_the_gateways_v2_front":
        "starts its own tritonserver and gateway and runs perf_analyzer and the engine at a request rate",
    "test_profile.py::test_triton_direct_over_grpc_with_repeated_runs_and_their_intervals_compared":
        "profiles a paced tritonserver of its own over gRPC, three timed runs",
    "test_profile.py::test_search_finds_the_known_capacity_within_10_percent":
        "searches a paced tritonserver's capacity with timed load levels",
    "test_profile.py::test_a_pause_shows_as_a_queue_in_open_loop_and_hides_in_closed_loop":
        "SIGSTOPs its own tritonserver during timed load levels",
    "test_profile.py::test_bad_use_is_one_line_a_nonzero_exit_and_nothing_written":
        "runs unroll profile in fresh processes against its own servers",
    "test_profile.py::test_a_gateway_with_a_key_is_profiled_through_v1_and_v2_and_refuses_a_wrong_key_or_model":
        "profiles a gateway of its own in front of its own tritonserver",
    "test_quality_gates.py::test_all_int8_fails_the_worst_image_gate_and_the_chosen_placement_passes":
        "two INT8 quantizations with their gates (minutes)",
    "test_quantize.py::test_int8_explicit_qdq_passes_gate": "INT8 quantization with calibration and gates",
    "test_quantize.py::test_fp16_passes_gate_with_fp32_io_and_carries_the_card[csc-denoiser]":
        "the denoiser's FP16 gate: every validation and stress image at three σ (~10 s)",
    "test_quantize.py::test_the_repository_serves_a_quantized_graph_with_the_rule_measured_on_it":
        "quantizes in a fresh CLI process, then measures both graphs' OOD verdicts (a benchmark's measure)",
    "test_quantize.py::test_failed_gate_writes_no_artifact_and_says_why":
        "the denoiser's FP16 gate: every validation and stress image at three σ (~10 s)",
    "test_registry_cli.py::test_recipe_evaluation_reproduces_the_committed_metrics":
        "evaluates every recipe's committed metrics",
    "test_registry_cli.py::test_cli_train_smoke_every_recipe": "trains every recipe briefly",
    "test_robustness.py::test_smoke_run_is_deterministic_and_chooses_lambda_on_validation":
        "runs unroll bench robustness twice (a benchmark run)",
    "test_robustness.py::test_served_graphs_per_precision_and_fp32_onnx_equals_pytorch":
        "reads the unroll bench robustness run (~11 s) the determinism test repeats",
    "test_robustness.py::test_a_precision_the_gate_refuses_is_reported_with_the_reason":
        "runs unroll bench robustness with a precision its gate refuses (a benchmark run)",
    "test_robustness.py::test_lambda_curve_has_one_point_per_grid_lambda_and_chooses_on_validation":
        "reads the unroll bench robustness run (~11 s) the determinism test repeats",
    "test_rvt.py::test_exported_graph_matches_the_official_logits": "exports and verifies RVT graphs",
    "test_rvt.py::test_exported_attention_and_micro_model_match_the_official_code": "exports and verifies RVT graphs",
    "test_rvt.py::test_served_rvt_answers_like_pytorch": "serves RVT graphs on its own tritonserver",
    "test_rvt.py::test_fp16_passes_its_gate_on_held_out_photo_crops": "quantizes RVT to FP16 and runs its gate",
    "test_serve_models.py::test_gateway_lists_only_the_asked_model": "starts its own unroll serve of one model",
    "test_serve_models.py::test_triton_loads_only_the_asked_model": "starts its own unroll serve of one model",
    "test_staleness.py::test_after_a_re_export_nothing_is_stale": "re-exports the demo classifier and rebuilds",
    "test_triton_down.py::test_every_route_answers_while_triton_is_stopped_killed_and_restarting":
        "stops, kills and restarts the tritonserver of its own unroll serve",
    "test_torch_runtime_gpu_paths.py::test_through_the_real_tritonserver_the_dlpack_path_answers_as_the_numpy_path":
        "pauses (SIGSTOP) a tritonserver of its own on a bf16 torch-runtime repository",
    "test_trt_build.py::test_the_widest_default_profile_of_each_family_fits_the_budget":
        "exports the widest default profile of every family",
}


def tier_of(item: pytest.Item) -> str | None:
    """The ``full`` reason of a collected test (its entry with its parameters, else its function's, else its
    file's), or None: a ``check`` test."""
    file = item.path.name
    function = item.originalname if isinstance(item, pytest.Function) else item.name
    for key in (f"{file}::{item.name}", f"{file}::{function}", file):
        if key in FULL:
            return FULL[key]
    return None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by them
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test gets its tier's marker (the table above), then the longest files go first."""
    for item in items:
        reason = tier_of(item)
        item.add_marker(pytest.mark.full(reason) if reason is not None else pytest.mark.check)
    _longest_files_first(items)


def _longest_files_first(items: list[pytest.Item]) -> None:
    """The files that may take longest first (their largest ``timeout`` mark, then whether they have a ``slow``
    test; order otherwise kept): under ``make test``'s workers (one file per worker at a time) the long files start
    early instead of ending the run alone."""
    def weight(item: pytest.Item) -> tuple[float, bool]:
        mark = item.get_closest_marker("timeout")
        return (float(mark.args[0]) if mark is not None and mark.args else 0.0), bool(item.get_closest_marker("slow"))

    per_file: dict[Path, tuple[float, bool]] = {}
    for item in items:
        per_file[item.path] = max(per_file.get(item.path, (0.0, False)), weight(item))
    items.sort(key=lambda item: (-per_file[item.path][0], not per_file[item.path][1]))


#: UNROLL_TEST_CPU=PREFIX: each test process writes PREFIX.<worker>.json, the CPU seconds (user + system, its own and
#: its reaped children's: the servers a file's fixtures started and stopped) spent per test file, setup and teardown
#: included, to find where the suite's time goes (a session fixture's server counts in the process's last file)
_CPU_REPORT = os.environ.get("UNROLL_TEST_CPU")
_cpu_by_file: dict[str, float] = defaultdict(float)


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    before = _cpu_s() if _CPU_REPORT else 0.0
    yield
    if _CPU_REPORT:
        _cpu_by_file[item.path.name] += _cpu_s() - before


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _CPU_REPORT:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(f"{_CPU_REPORT}.{worker}.json").write_text(json.dumps({"total_s": _cpu_s(), "files": _cpu_by_file}))


@pytest.fixture(autouse=True, scope="session")
def _threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def demo_onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served demo graphs (sdnet-mnist with its λ-rule companion, csc-denoiser), exported once per session
    and shared by every test module that needs an export of them."""
    from unroll.export.onnx_export import export_model

    out = tmp_path_factory.mktemp("demo_onnx")
    export_model("sdnet-mnist", out, naive=False)
    export_model("csc-denoiser", out, naive=False)
    return out


@pytest.fixture(scope="session")
def demo_triton(demo_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonHandle]:
    """The session's one tritonserver on the demo models (:func:`served.shared_triton`), started by the first test
    that asks for it; for tests that only send it requests."""
    with shared_triton(demo_onnx_dir, tmp_path_factory.mktemp("demo_triton")) as handle:
        yield handle


@pytest.fixture(scope="session")
def demo_gateway(demo_triton: TritonHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """The session's one gateway with default settings in front of :func:`demo_triton` (a client of it), started by
    the first test that asks for it; for tests that only send it requests. A test that needs other settings, reads
    its log or counts its metrics from zero starts its own (``served.gateway_over``)."""
    with gateway_over(demo_triton, tmp_path_factory.mktemp("demo_gateway")) as client:
        yield client
