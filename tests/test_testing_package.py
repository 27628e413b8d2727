"""compilepack.testing is a package whose names are a public contract: everything its single module exported
before the split is still importable from ``compilepack.testing``, with the pytest fixtures."""

from __future__ import annotations

import compilepack.cli.check
from compilepack import testing

CONTRACT = [  # the module's __all__ before it became a package
    "ATTENTION_ONLY_TOLERANCE", "BF16_BAR", "HYBRID_TOLERANCE", "CheckResult", "PackedBatch", "assert_bf16_close",
    "assert_compiles_once", "assert_documents_isolated", "assert_packed_matches_unpacked",
    "assert_refuses_bad_batches", "build_model", "check_bf16_close", "check_compiles_once",
    "check_documents_isolated", "check_packed_matches_unpacked", "check_refuses_bad_batches", "chunk_size_of",
    "malformed_batches", "packed_batch", "packed_batches", "position_ids_only", "reduced_config", "tolerance_for",
    "varied_batches",
]


def test_the_public_names_survive_the_split():
    assert set(CONTRACT) <= set(testing.__all__)
    assert all(hasattr(testing, name) for name in testing.__all__)
    from compilepack.testing import compilepack_batch_factory, compilepack_model_factory  # the plugin's fixtures

    assert compilepack_model_factory.__name__ == "compilepack_model_factory"
    assert compilepack_batch_factory.__name__ == "compilepack_batch_factory"


def test_check_command_has_no_loader_or_builder_of_its_own():
    """One config loader and one model builder: compilepack.testing.models', which the command calls."""
    assert not {"_config", "_builder", "_refuse_remote_code"} & set(vars(compilepack.cli.check))
    assert set(compilepack.cli.check.CHECKS) == set(testing.CHECK_NAMES)
