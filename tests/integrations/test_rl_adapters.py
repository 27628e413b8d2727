"""Packed log-prob passes without a trainer (issue 51): TRL's padded layouts run as one packed row
(``PackedModelCall``) give each sequence's per-token log-probs as if it ran alone, for one family of each mixer kind;
``boundary_kwargs`` turns verl's, OpenRLHF's and prime-rl's packed layouts into compilepack's boundaries. Every
equality has its control: the boundaries dropped (the packed row run as one sequence) miss by far.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import compilepack
from compilepack.errors import BoundaryError, CompilepackError
from compilepack.integrations import boundary_kwargs
from compilepack.integrations import rl_trainers as packing
from compilepack.integrations.rl_trainers import PackedModelCall, RowSpans
from compilepack.patching import family_named
from compilepack.testing import padded_batch
from tests.families import build_tiny

pytest.importorskip("trl")
from trl.trainer.utils import add_fused_lm_head

# one family per mixer kind; the README's command runs llama and qwen3_5 (about 20 s), the slow stage all four
FAMILIES = ["llama", "qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.slow),
            pytest.param("bamba", marks=pytest.mark.slow)]
# fp32, per-token log-probs of a packed row vs each sequence alone; measured 5.9e-7 to 6.9e-7 (the 4 families)
TOLERANCE = 1e-5
# the same with the boundaries dropped (the packed row as one sequence) must miss by more than this
MIXED = 1e-2
PAD = 0
# GRPO: prompts left-padded, completions right-padded (a 1-token completion, one cut at max_completion_length,
# one past the mixers' 64-token chunk with its prompt)
PROMPTS, COMPLETIONS = [5, 17, 3, 30], [1, 12, 9, 40]
# DPO: prompt + chosen, then prompt + rejected, right-padded
DPO_PROMPTS, CHOSEN, REJECTED = [6, 20, 3], [8, 1, 50], [30, 4, 2]


@pytest.fixture(scope="module", params=FAMILIES)
def models(request):
    """(stock, patched with TRL's fused head) with the same weights."""
    torch.manual_seed(0)
    stock = build_tiny(family_named(request.param)).eval()
    model = copy.deepcopy(stock)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return stock, compilepack.patch(model)


def random_tokens(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def grpo_batch(vocab_size: int):
    """TRL GRPO's layout: ``[prompt padded left | completion padded right]``, labels on the completions only."""
    prompts, completions = random_tokens(vocab_size, PROMPTS, 1), random_tokens(vocab_size, COMPLETIONS, 2)
    width_p, width_c = max(PROMPTS), max(COMPLETIONS)
    ids = [[PAD] * (width_p - len(p)) + p + c + [PAD] * (width_c - len(c)) for p, c in zip(prompts, completions)]
    mask = [[0] * (width_p - len(p)) + [1] * (len(p) + len(c)) + [0] * (width_c - len(c))
            for p, c in zip(prompts, completions)]
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-width_c] = -100
    sequences = [p + c for p, c in zip(prompts, completions)]
    scored = [(width_p - 1, len(c)) for c in completions]  # (first column of the completion's scores, how many)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, sequences, scored


def dpo_batch(vocab_size: int):
    """TRL DPO's layout: the chosen rows, then the rejected ones, right-padded; labels on the completions."""
    prompts = random_tokens(vocab_size, DPO_PROMPTS, 3)
    completions = random_tokens(vocab_size, CHOSEN, 4) + random_tokens(vocab_size, REJECTED, 5)
    sequences = [p + c for p, c in zip(prompts * 2, completions)]
    padded = padded_batch(sequences, pad_token_id=PAD)
    ids, mask, width = padded["input_ids"], padded["attention_mask"], padded["input_ids"].shape[1]
    completion = torch.tensor([[0] * len(p) + [1] * len(c) + [0] * (width - len(p) - len(c))
                               for p, c in zip(prompts * 2, completions)])
    scored = [(len(p) - 1, len(c)) for p, c in zip(prompts * 2, completions)]
    labels = ids.masked_fill(completion == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, sequences, scored


def alone(stock, sequence: list[int]) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) of one sequence run alone (fp64 softmax)."""
    with torch.no_grad():
        logits = stock(input_ids=torch.tensor([sequence]), use_cache=False).logits[0].double()
    return F.log_softmax(logits[:-1], -1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]


def worst_error(log_probs: torch.Tensor, stock, sequences, scored) -> float:
    worst = 0.0
    for row, (sequence, (first, count)) in enumerate(zip(sequences, scored)):
        expected = alone(stock, sequence)[-count:]
        worst = max(worst, (log_probs[row, first:first + count].double() - expected).abs().max().item())
    return worst


def without_boundaries(monkeypatch):
    """The control: the packed row handed to the model as one sequence (positions and boundaries dropped)."""
    pack = packing._packed_inputs

    def one_sequence(*args):
        return {k: v for k, v in pack(*args).items() if k in ("input_ids", "shift_labels")}

    monkeypatch.setattr(packing, "_packed_inputs", one_sequence)


@pytest.mark.parametrize("layout", [grpo_batch, dpo_batch])
def test_packed_pass_equals_each_sequence_alone_in_trls_layouts(models, layout, monkeypatch):
    stock, model = models
    batch, sequences, scored = layout(stock.config.vocab_size)
    with torch.no_grad():
        out = PackedModelCall(model)(**batch, fused_lm_head=True)
    assert out.log_probs.shape == out.entropy.shape == (batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1)
    assert worst_error(out.log_probs, stock, sequences, scored) <= TOLERANCE
    assert not out.log_probs[~out.label_mask].any() and not out.entropy[~out.label_mask].any()  # TRL's zeros

    without_boundaries(monkeypatch)
    with torch.no_grad():
        mixed = PackedModelCall(model)(**batch, fused_lm_head=True)
    assert worst_error(mixed.log_probs, stock, sequences, scored) > MIXED


def test_packed_pass_gradients_reach_the_model():
    torch.manual_seed(0)
    model = build_tiny(family_named("llama"))
    add_fused_lm_head(model)
    compilepack.patch(model)
    batch, _, _ = dpo_batch(model.config.vocab_size)
    PackedModelCall(model)(**batch, fused_lm_head=True).log_probs.sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0 and model.model.embed_tokens.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------ refusals


def test_row_spans_left_right_and_both_paddings():
    spans = RowSpans.of(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 1, 1, 0]]))
    assert (spans.starts, spans.lengths, spans.offsets) == ((2, 0, 1), (3, 2, 3), [0, 3, 5])
    assert spans.token_index().tolist() == [2, 3, 4, 5, 6, 11, 12, 13]


@pytest.mark.parametrize("mask", [[[1, 0, 1, 1]], [[0, 0, 0, 0]]], ids=["gap", "empty"])
def test_row_with_a_gap_or_no_token_is_refused(mask):
    with pytest.raises(BoundaryError, match=r"attention_mask: rows \[0\] are not one run of tokens"):
        RowSpans.of(torch.tensor(mask))


def test_labels_the_packed_row_cannot_score_are_refused(models):
    _, model = models
    batch, _, _ = dpo_batch(64)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, 0] = 5  # a label on a sequence's first token: no token before it
    with pytest.raises(BoundaryError, match=r"labels: 1 label\(s\) outside .* first at \(row, column\) \[0, 0\]"):
        PackedModelCall(model)(**batch, fused_lm_head=True)


def test_multimodal_inputs_and_an_unpatched_model_are_refused(models):
    stock, model = models
    batch, _, _ = dpo_batch(64)
    with pytest.raises(CompilepackError, match=r"passed \['pixel_values'\]"):
        PackedModelCall(model)(**batch, fused_lm_head=True, pixel_values=torch.zeros(1))
    with pytest.raises(CompilepackError, match=r"without an attention_mask \(\['position_ids'\]"):
        PackedModelCall(model)(input_ids=batch["input_ids"], labels=batch["labels"], fused_lm_head=True,
                               position_ids=torch.arange(batch["input_ids"].shape[1])[None])
    with pytest.raises(CompilepackError, match="not compilepack-patched"):
        PackedModelCall(stock)(**batch, fused_lm_head=True)


def test_trainers_without_a_seam_are_refused():
    """(Under context parallelism the passes compose: tests/integrations/test_rl_context_parallel.py.)"""
    from transformers import Trainer

    from compilepack.integrations import packed_logprobs

    with pytest.raises(CompilepackError, match="Trainer has neither"):
        packed_logprobs(Trainer)


# ------------------------------------------------------------------------------------------------ boundary_kwargs

LENGTHS = [9, 1, 70, 4]


def self_packed_layouts(vocab_size: int):
    """The same sequences packed as verl, OpenRLHF and prime-rl pack them (the row and the lengths they hold)."""
    sequences = random_tokens(vocab_size, LENGTHS, 7)
    batch = padded_batch(sequences, pad_token_id=PAD)
    padded, mask = batch["input_ids"], batch["attention_mask"]
    # verl: flash-attn's unpad_input(input_ids.unsqueeze(-1), attention_mask): tokens where the mask is set, and
    # cu_seqlens = F.pad(cumsum(seqlens), (1, 0)) (int32); its Ulysses padding is one more segment at the end
    rmpad = padded[mask.bool()][None]
    cu_seqlens = F.pad(mask.sum(-1).cumsum(0, dtype=torch.int32), (1, 0))
    verl_padded = torch.cat([rmpad, torch.full((1, 3), PAD)], 1)
    packed = torch.tensor([[t for s in sequences for t in s]])
    return sequences, {
        "verl": (rmpad, {"cu_seqlens": cu_seqlens}),
        "verl (padded for Ulysses)": (verl_padded, {"cu_seqlens": torch.cat([cu_seqlens, cu_seqlens[-1:] + 3])}),
        "openrlhf": (packed, {"lengths": LENGTHS}),  # packing_samples: packed_seq_lens, a list
        # prime-rl: seq_lens of a micro-batch row, a tensor, the row's tail padding its own sample
        "prime-rl": (torch.cat([packed, torch.full((1, 2), PAD)], 1), {"lengths": torch.tensor([*LENGTHS, 2])}),
    }


@pytest.mark.parametrize("family_name", ["qwen3_5"])
def test_boundary_kwargs_from_each_frameworks_layout_equal_each_sequence_alone(family_name):
    torch.manual_seed(0)
    stock = build_tiny(family_named(family_name)).eval()
    model = compilepack.patch(copy.deepcopy(stock))
    sequences, layouts = self_packed_layouts(stock.config.vocab_size)
    expected = [alone(stock, s) for s in sequences]
    for name, (tokens, lengths) in layouts.items():
        kwargs = boundary_kwargs(tokens, **lengths)
        compilepack.validate({"input_ids": tokens, **kwargs})
        with torch.no_grad():
            logits = model(input_ids=tokens, **kwargs, use_cache=False).logits[0].double()
        log_probs = F.log_softmax(logits, -1)
        starts = kwargs["cu_seq_lens_q"].tolist()
        for sequence, reference, start in zip(sequences, expected, starts):
            got = log_probs[start:start + len(sequence) - 1].gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
            assert len(sequence) == 1 or (got - reference).abs().max().item() <= TOLERANCE, name

    # the control: what those frameworks hand a hybrid, position_ids alone, mixes the sequences in stock
    tokens, lengths = layouts["openrlhf"]
    positions = boundary_kwargs(tokens, **lengths)["position_ids"]
    with torch.no_grad():
        logits = stock(input_ids=tokens, position_ids=positions, use_cache=False).logits[0].double()
    third = slice(sum(LENGTHS[:2]), sum(LENGTHS[:3]) - 1)
    got = F.log_softmax(logits[third], -1).gather(1, torch.tensor(sequences[2][1:])[:, None])[:, 0]
    assert (got - expected[2]).abs().max().item() > MIXED


def test_boundary_kwargs_layout():
    kwargs = boundary_kwargs(torch.zeros(1, 6, dtype=torch.long), lengths=[2, 0, 4])
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 2, 2, 6] and kwargs["max_length_q"] == 4
    assert kwargs["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3]]
    assert kwargs["seq_idx"].tolist() == [[0, 0, 2, 2, 2, 2]]
    two_rows = boundary_kwargs(torch.zeros(2, 3, dtype=torch.long), cu_seqlens=[0, 3, 6])
    assert two_rows["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("given, message", [
    ({}, "exactly one of lengths= .* got neither"),
    ({"lengths": [3, 3], "cu_seqlens": [0, 3, 6]}, "got both"),
    ({"lengths": [3, 2]}, r"add up to 5 tokens, but input_ids holds 6 .*lengths \+ \[1\]"),
    ({"cu_seqlens": [1, 6]}, "must start at 0"),
    ({"cu_seqlens": [0, 4, 3, 6]}, "never step back"),
    ({"lengths": torch.tensor([[3, 3]])}, "1-D integer tensor"),
])
def test_boundary_kwargs_refuses_what_names_no_layout(given, message):
    with pytest.raises(BoundaryError, match=message):
        boundary_kwargs(torch.zeros(1, 6, dtype=torch.long), **given)
