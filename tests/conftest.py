"""Shared fixtures: the real embedded model (loaded once per session) and tiny random models."""

from __future__ import annotations

import os

import pytest
import torch

# the tests run in two pytest-xdist workers (pyproject's addopts) on a 2-core machine: one core each
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="session")
def real_model():
    from sparsekv.models import load_model

    model, tokenizer = load_model("default", dtype=torch.float32)
    return model, tokenizer


@pytest.fixture(scope="session")
def real_model_fp64(real_model):
    import copy

    model, tokenizer = real_model
    return copy.deepcopy(model).to(torch.float64), tokenizer


def pytest_collection_modifyitems(config, items):
    """The kernel files' interpreter runs (`helpers.run_under_interpreter`) go first: each is one test of several
    minutes (one near fifteen on a 2-core machine), and one that starts last leaves the other worker idle while it
    finishes. pytest-xdist's worksteal hands the first half of this order to one worker and steals from it."""
    items.sort(key=lambda item: item.originalname != "test_kernels_under_interpreter")
