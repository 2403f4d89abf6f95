"""Fixtures of the chaos suite."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory):
    """The tiny Llama every chaos job trains (built once for the package)."""
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0
    )  # vLLM CPU attention needs head_dim >= 32
