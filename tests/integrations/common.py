"""Shared pieces of the integration tests: per-sample reference losses, a loss-recording Trainer, tiny data."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from compilepack.batch.keys import IGNORE_INDEX
from tests.models import random_docs

# Document lengths of the training set: longer than the mixers' chunk (64), 1-token documents, ordinary ones.
LENGTHS = [37, 5, 70, 12, 1, 44, 20, 9, 66, 3, 30, 15]
# First-step loss vs the per-sample reference (losses ~5.5, fp32). Measured: 1.9e-7 to 3.2e-7 (llama, qwen3_5,
# bamba, HF Trainer and TRL).
LOSS_TOLERANCE = 5e-6
# Running the packed row as one sequence (documents mixed) moves these tiny random models' loss by 1.0e-3 to
# 5.3e-3 (measured): well above the tolerance, so the comparison tells a correct packed step from a mixing one.
MIXING_SHIFT = 2e-4
# What the Trainer tests run: 3 compiled steps on the CPU, every loss logged, nothing saved or reported.
TRAINING_ARGS = dict(
    per_device_train_batch_size=4,
    max_steps=3,
    learning_rate=1e-3,
    torch_compile=True,
    torch_compile_backend="aot_eager",  # the same graphs as inductor, without its CPU code generation
    remove_unused_columns=False,
    report_to=[],
    save_strategy="no",
    logging_steps=1,
    use_cpu=True,
    dataloader_num_workers=0,
    disable_tqdm=True,
)


def training_docs(vocab_size: int = 256, seed: int = 0) -> list[list[int]]:
    return random_docs(vocab_size, LENGTHS, seed=seed)


def documents(batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) of every document of a packed batch, split at its ``cu_seq_lens_q``."""
    cu = batch["cu_seq_lens_q"].tolist()
    ids, labels = batch["input_ids"].flatten(), batch["labels"].flatten()
    return [(ids[s:e], labels[s:e]) for s, e in zip(cu[:-1], cu[1:])]


def per_sample_loss(stock, batch) -> tuple[float, int]:
    """The HF causal-LM loss of ``batch`` computed from each document run alone through ``stock``.

    Each document's summed cross-entropy over its own shifted labels, added over documents and divided by the
    number of labelled targets of the whole batch: the token-weighted mean that the HF loss (with Trainer's
    ``num_items_in_batch``) takes over the packed row. Returns (loss, number of targets).
    """
    total, targets = 0.0, 0
    with torch.no_grad():
        for ids, labels in documents(batch):
            if len(ids) < 2:
                continue
            logits = stock(input_ids=ids[None], use_cache=False).logits[0].double()
            total += F.cross_entropy(logits[:-1], labels[1:], reduction="sum", ignore_index=IGNORE_INDEX).item()
            targets += int((labels[1:] != IGNORE_INDEX).sum())
    return total / targets, targets


def assert_first_step_equals_per_sample_loss(trainer, stock, samples: list[list[int]]) -> dict:
    """A :func:`recording` trainer ran 3 steps of finite losses, and its first step's loss equals the per-sample
    loss of ``stock`` on that batch, whose documents are training samples (and which, run as one sequence, would
    give a loss off by more than :data:`MIXING_SHIFT`). Returns that first batch."""
    losses = trainer.recorded_losses
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
    first = trainer.recorded_batches[0]
    assert_batch_documents_are_samples(first, samples)
    reference, targets = per_sample_loss(stock, first)
    assert targets > 50
    assert abs(losses[0] - reference) <= LOSS_TOLERANCE, (losses[0], reference)
    assert abs(one_sequence_loss(stock, first) - reference) > MIXING_SHIFT
    return first


def one_sequence_loss(stock, batch) -> float:
    """The same batch's loss if its row were one sequence (documents mixed): the failure the tests must see."""
    with torch.no_grad():
        return stock(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss.item()


def assert_batch_documents_are_samples(batch, samples: list[list[int]]) -> None:
    """Every labelled document of the batch is exactly one training sample (the boundaries are the samples')."""
    for ids, labels in documents(batch):
        if (labels[1:] != IGNORE_INDEX).any():
            assert ids.tolist() in samples, f"document {ids.tolist()[:8]}... is not a training sample"


class RecordingMixin:
    """Trainer mixin: records every batch (on the host) and the loss ``compute_loss`` returns for it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
        self.recorded_batches.append(batch)
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        self.recorded_losses.append((loss[0] if return_outputs else loss).detach().item())
        return loss


def recording(trainer_cls):
    """``trainer_cls`` with :class:`RecordingMixin`; instances have ``recorded_batches`` / ``recorded_losses``."""

    class Recording(RecordingMixin, trainer_cls):
        def __init__(self, *args, **kwargs):
            self.recorded_batches, self.recorded_losses = [], []
            super().__init__(*args, **kwargs)

    return Recording


def dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far, from dynamo's counters."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def run_launched_cases(specs: str, out, run) -> None:
    """A torchrun worker's loop: each comma-separated case spec run on every rank (``run(spec)``) inside one gloo
    group, rank 0 saving the result to ``out/<spec, ':' as '-'>.pt``, the ranks meeting after each case."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for spec in specs.split(","):
            result = run(spec)
            if dist.get_rank() == 0:
                torch.save(result, out / f"{spec.replace(':', '-')}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()
