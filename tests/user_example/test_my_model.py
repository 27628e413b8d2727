"""What a user's own test file looks like: their model (here a small Qwen3.5 config standing in for a checkpoint's
config.json), compilepack's checks, the plugin's fixtures. Run with ``pytest -p compilepack.testing``."""

import pytest
import transformers

from compilepack import testing

MY_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("my-checkpoint")
    transformers.Qwen3_5TextConfig(**MY_CONFIG).save_pretrained(path)
    return path


def test_packing_is_exact_and_isolated(compilepack_model_factory, compilepack_batch_factory, checkpoint):
    model = compilepack_model_factory(checkpoint)  # one layer of each kind, random weights, patched
    batches = compilepack_batch_factory(model)[:1]  # the first case: 1-token documents, a chunk edge
    testing.assert_packed_matches_unpacked(model, batches)
    testing.assert_documents_isolated(model, batches)


def test_compiles_once(compilepack_model_factory, checkpoint):
    model = compilepack_model_factory(checkpoint)
    testing.assert_compiles_once(model, testing.varied_batches(MY_CONFIG["vocab_size"], count=3), backward=False)


def test_bad_batches_are_refused(compilepack_model_factory, checkpoint):
    testing.assert_refuses_bad_batches(compilepack_model_factory(checkpoint))
