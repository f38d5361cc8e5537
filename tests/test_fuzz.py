"""A fuzzer nobody here wrote: Schemathesis generates requests from the gateway's own OpenAPI document.

It runs against a real gateway process in front of a real tritonserver serving the demo models, bounded
in examples per operation, and checks what the issue asks: no 5xx, and every response conforms to the
schema (status code documented, content type and body as declared).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from unroll.serving.gateway.process import gateway_process
from unroll.serving.gateway.settings import Settings

EXAMPLES_PER_OPERATION = 40
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def api_schema(demo_triton, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    # the session's tritonserver serves every graph the demo models' cards name (λ rule, other iteration counts
    # iters=K), as `unroll serve` serves them
    logs = tmp_path_factory.mktemp("fuzz_logs")
    with gateway_process(Settings(triton_url=demo_triton.grpc_url, max_pixels=512 * 512,
                                  max_body_bytes=2 * 1024 * 1024), logs / "gateway.log") as base:
        yield schemathesis.openapi.from_url(f"{base}/openapi.json")


@pytest.mark.triton
@pytest.mark.slow
def test_generated_requests_get_no_5xx_and_match_the_schema(api_schema) -> None:
    """Every operation, ``EXAMPLES_PER_OPERATION`` generated cases each (Schemathesis' Hypothesis strategies,
    driven directly: its pytest plugin does not run under this pytest)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    seen: dict[tuple[str, int], int] = {}
    assert {op.label for op in operations} >= {"POST /v1/classify", "POST /v1/denoise", "GET /v1/models"}
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            response = case.call_and_validate(checks=CHECKS, timeout=30)
            key = (case.operation.label, response.status_code)
            seen[key] = seen.get(key, 0) + 1

        run()
    # the fuzzer really reached the models and really sent bad input (not only refusals, not only successes)
    assert seen.get(("POST /v1/classify", 200)) and any(k[0] == "POST /v1/denoise" and k[1] < 500 for k in seen)
    assert any(k[1] in (400, 404, 415, 422) for k in seen), seen
