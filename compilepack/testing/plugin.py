"""The pytest plugin (``pytest -p compilepack.testing``): fixtures that build a model and its packed batches."""

from __future__ import annotations

import pytest

from .batches import PackedBatch, chunk_size_of, packed_batches
from .models import build_model


@pytest.fixture
def compilepack_model_factory():
    """``factory(model, layers="per_kind", seed=0, patch=True)``: :func:`build_model` (a family name, a config,
    or a checkpoint's directory or config.json; random weights, fp32, eval mode)."""
    return build_model


@pytest.fixture
def compilepack_batch_factory():
    """``factory(model)``: :func:`packed_batches` for this model's vocabulary and chunk size."""

    def factory(model, seed: int = 0) -> list[PackedBatch]:
        config = model.config
        return packed_batches(config.get_text_config().vocab_size, chunk=chunk_size_of(config), seed=seed)

    return factory
