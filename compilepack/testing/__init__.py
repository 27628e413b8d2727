"""Prove packing on your own model, in your own tests: the checks compilepack's own family tests run.

Each check is a plain function that raises ``AssertionError`` carrying the measured figures, so it fits any test
runner::

    import compilepack
    from compilepack import testing

    model = testing.build_model(name)    # family name, config or checkpoint: patched, random weights
    batches = testing.packed_batches(model.config.get_text_config().vocab_size)
    testing.assert_packed_matches_unpacked(model, batches)        # forward logits and gradients, fp32
    testing.assert_documents_isolated(model, batches)             # bit for bit, zero gradient across documents
    testing.assert_compiles_once(model, testing.varied_batches(model.config.get_text_config().vocab_size))
    testing.assert_bf16_close(model, batches[0])                  # within 2x the model's own bf16 error
    testing.assert_refuses_bad_batches(model)                     # malformed batches: refused or run exactly

Each ``assert_*`` has a ``check_*`` twin returning a :class:`CheckResult` instead of raising (``python -m
compilepack check`` prints those). A ``check_*`` never raises: an error the model raises is a failed result
carrying it, and its ``assert_*`` raises ``AssertionError`` from that error. Loaded as a pytest plugin (``pytest
-p compilepack.testing``), the package adds the fixtures ``compilepack_model_factory`` and
``compilepack_batch_factory``.

The reference for "each document alone" is the model itself run on each document as a plain, unpacked batch
(a patched model runs stock code there), unless another ``reference`` model is given.

Modules: ``batches`` (what the checks run, and the padded batch stock trains on), ``models`` (the config loader
and model builder, shared with ``python -m compilepack check``, and :func:`stock_path`), ``reference`` (each
document alone, tolerances), ``exactness``, ``compiles``, ``precision``, ``refusal`` (the checks), ``explain``
(graphs, breaks and compiles counted: ``compilepack.explain``, ``compilepack.count_compiles``), ``results``
(:class:`CheckResult`), ``plugin`` (the fixtures).
"""

from __future__ import annotations

from .batches import (
    DEFAULT_CHUNK,
    MALFORMED_LENGTHS,
    PackedBatch,
    chunk_size_of,
    malformed_batches,
    malformed_documents,
    packed_batch,
    packed_batches,
    padded_batch,
    position_ids_only,
    varied_batches,
)
from .compiles import assert_compiles_once, check_compiles_once
from .exactness import (
    CONTROL_FACTOR,
    assert_documents_isolated,
    assert_packed_matches_unpacked,
    check_documents_isolated,
    check_packed_matches_unpacked,
)
from .models import ConfigError, build_model, causal_lm_builder, layer_kinds, load_config, reduced_config, stock_path
from .precision import BF16_BAR, assert_bf16_close, check_bf16_close
from .reference import ATTENTION_ONLY_TOLERANCE, HYBRID_TOLERANCE, summed_token_loss, tolerance_for
from .refusal import assert_refuses_bad_batches, check_refuses_bad_batches
from .results import CHECK_NAMES, CheckResult, first_line

try:
    import pytest  # noqa: F401 - only the plugin's fixtures need it; the checks run without pytest
except ImportError:
    pass
else:
    from .plugin import compilepack_batch_factory, compilepack_model_factory  # noqa: F401 - found by pytest

__all__ = [
    "ATTENTION_ONLY_TOLERANCE",
    "BF16_BAR",
    "CHECK_NAMES",
    "HYBRID_TOLERANCE",
    "CheckResult",
    "ConfigError",
    "PackedBatch",
    "assert_bf16_close",
    "assert_compiles_once",
    "assert_documents_isolated",
    "assert_packed_matches_unpacked",
    "assert_refuses_bad_batches",
    "build_model",
    "causal_lm_builder",
    "check_bf16_close",
    "check_compiles_once",
    "check_documents_isolated",
    "check_packed_matches_unpacked",
    "check_refuses_bad_batches",
    "chunk_size_of",
    "load_config",
    "malformed_batches",
    "malformed_documents",
    "packed_batch",
    "packed_batches",
    "padded_batch",
    "position_ids_only",
    "reduced_config",
    "stock_path",
    "tolerance_for",
    "varied_batches",
]
