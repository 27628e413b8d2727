"""TRL ``SFTTrainer`` with ``padding_free=True`` on a patched, compiled model (optional: skipped without trl).

TRL's padding-free collator (1.16) emits the HF boundary kwargs itself (``cu_seq_lens_q/k``, ``max_length_q/k``,
``seq_idx``, ``position_ids``); it is wrapped in ``with_boundaries`` anyway, which validates every batch and
adds the kwargs for TRL versions or collators that emit ``position_ids`` only.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is an optional test dependency: pip install 'trl>=1.16'")
from packaging.version import Version  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

import compilepack  # noqa: E402
from compilepack.boundaries import BOUNDARY_KEYS  # noqa: E402
from compilepack.integrations import with_boundaries  # noqa: E402
from compilepack.patching import family_named  # noqa: E402
from tests.families import build_tiny  # noqa: E402
from tests.integrations.common import (  # noqa: E402
    LOSS_TOLERANCE,
    TRAINING_ARGS,
    assert_first_step_equals_per_sample_loss,
    per_sample_loss,
    recording,
    training_docs,
)
from tests.models import build_pair  # noqa: E402


def word_tokenizer(vocab_size: int = 256):
    """A word-level tokenizer built in code ("t0".."t255"): SFTTrainer needs a processing class, nothing downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", unk_token="t1", eos_token="t2")


def test_sft_trainer_padding_free_compiled_first_step_equals_per_sample_loss(tmp_path):
    from datasets import Dataset

    torch.manual_seed(0)
    model = build_tiny(family_named("llama"))
    stock = copy.deepcopy(model).eval()
    samples = training_docs(model.config.vocab_size)
    args = SFTConfig(
        output_dir=str(tmp_path),
        padding_free=True,
        max_length=None,  # padding-free without packing: samples are used whole
        bf16=False,  # SFTConfig turns bf16 autocast on by default; see test_known_issues.py
        **TRAINING_ARGS,
    )
    trainer = recording(SFTTrainer)(
        model=compilepack.patch(model),
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": samples}),
        processing_class=word_tokenizer(model.config.vocab_size),
    )
    # SFTTrainer refuses a custom collator with padding_free=True, so its own is wrapped after construction
    assert isinstance(trainer.data_collator, DataCollatorForLanguageModeling) and trainer.data_collator.padding_free
    trainer.data_collator = with_boundaries(trainer.data_collator)
    trainer.train()

    first = assert_first_step_equals_per_sample_loss(trainer, stock, samples)
    assert "attention_mask" not in first


@pytest.mark.parametrize("pad_to_multiple_of", [None, 16])
@pytest.mark.parametrize("packed_rows", [False, True], ids=["samples", "bfd-packed-rows"])
def test_trl_padding_free_collator_emits_valid_boundaries(pad_to_multiple_of, packed_rows):
    """What TRL's collator emits, checked key by key; a patched model's loss on it equals the per-sample loss."""
    stock, patched = build_pair(family_named("llama"))
    samples = training_docs(stock.config.vocab_size)[:6]
    if packed_rows:  # what SFTTrainer(packing=True, packing_strategy="bfd") feeds it: rows with seq_lengths
        features = [
            {"input_ids": samples[0] + samples[1], "seq_lengths": [len(samples[0]), len(samples[1])]},
            {"input_ids": [t for s in samples[2:] for t in s], "seq_lengths": [len(s) for s in samples[2:]]},
        ]
    else:
        features = [{"input_ids": s} for s in samples]
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=pad_to_multiple_of)
    batch = collate(features)

    if Version(trl.__version__) >= Version("1.16"):
        assert set(BOUNDARY_KEYS) <= set(batch), sorted(batch)
    batch = with_boundaries(lambda _: batch)(features)  # validates; adds the kwargs if this TRL lacks them
    boundaries = compilepack.validate(batch)
    total = sum(len(s) for s in samples)
    # TRL pads with position 0, so each padding token is a one-token document with label -100
    padding = [1] * (batch["input_ids"].shape[1] - total)
    assert boundaries.lengths == [len(s) for s in samples] + padding
    assert batch["max_length_q"] == max(len(s) for s in samples)
    with torch.no_grad():
        packed_loss = patched(**batch).loss.item()
    assert abs(packed_loss - per_sample_loss(stock, batch)[0]) <= LOSS_TOLERANCE
