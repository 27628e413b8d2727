"""compilepack.testing is a package whose names are a public contract: everything its single module exported
before the split is still importable from ``compilepack.testing``, with the pytest fixtures. Plus the helpers the
benchmark and the GPU check share with users: the padded batch stock trains on, the code stock runs."""

from __future__ import annotations

import torch

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


def test_the_padded_batch_pads_right_and_masks_the_pads():
    batch = testing.padded_batch([[5, 6, 7], [8]], multiple_of=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, -100], [8, -100, -100, -100]]
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == torch.long


def test_stock_path_names_the_fallbacks_a_hybrid_runs():
    from transformers import AutoModelForCausalLM

    from compilepack.patching import family_named

    hybrid = AutoModelForCausalLM.from_config(family_named("qwen3_5").bench_config())
    path = testing.stock_path(hybrid)  # the device: the model's
    assert path.startswith("cpu; attention: sdpa; ")
    assert "causal_conv1d_fn: torch fallback" in path and "torch_chunk_gated_delta_rule: torch fallback" in path
    attention_only = AutoModelForCausalLM.from_config(family_named("llama").bench_config())
    assert testing.stock_path(attention_only, "cpu") == "cpu; attention: sdpa"  # the control: no kernel globals
