"""Shared test set-up: deterministic, 2 threads (the CI machine's cores)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _threads() -> None:
    torch.set_num_threads(2)
