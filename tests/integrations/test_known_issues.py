"""Core issues found while integrating, fixed, and kept as regression tests: bf16 autocast through packed
attention, patching after fully_shard, and LoRA on Bamba's out_proj where the fused CUDA route would drop it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import compilepack
from compilepack.patching import family_named, patch_state
from tests.families import build_tiny
from tests.models import build_pair, hf_batch, logits_alone, max_diff_packed_vs_alone, random_docs


@pytest.mark.parametrize("family_name", ["llama", "qwen3_5"])
def test_packed_forward_under_bf16_autocast(family_name):
    stock, patched = build_pair(family_named(family_name))
    docs = random_docs(stock.config.vocab_size, [30, 5, 20])
    batch = hf_batch(docs)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed = patched(**batch).logits.float()
        alone = [logits.float() for logits in logits_alone(stock, docs)]
    # bf16 rounding of logits of size ~1: measured 3.9e-3 with the fix applied
    assert max_diff_packed_vs_alone(packed, alone, batch["cu_seq_lens_q"]) <= 2e-2


@pytest.fixture
def single_rank_group():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_patch_after_fully_shard_patches_the_decoder(single_rank_group):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = build_tiny(family_named("llama"))
    fully_shard(model.model)
    fully_shard(model)
    compilepack.patch(model)
    assert type(model.model) in {type(m) for m in patch_state(model).modules}


def test_packed_bamba_training_keeps_lora_on_out_proj():
    """Packed Bamba mixers take the unfused path, where LoRA adapters on in_proj and out_proj are used: their
    gradients exist and equal the sum of each document trained alone (a fused kernel handed raw weights would
    bypass out_proj's adapter and leave its gradients None)."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from tests.models import relative_grad_error, summed_token_loss

    torch.manual_seed(0)
    base = build_tiny(family_named("bamba"))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["in_proj", "out_proj"], init_lora_weights=False))
    docs = random_docs(model.config.vocab_size, [30, 5, 20])
    batch = hf_batch(docs)
    compilepack.patch(model).train()
    summed_token_loss(model(**batch).logits, batch["labels"]).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    compilepack.unpatch(model)
    for doc in docs:
        alone = hf_batch([doc])
        summed_token_loss(model(input_ids=alone["input_ids"], use_cache=False).logits, alone["labels"]).backward()
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    out_proj = [n for n in packed if ".out_proj.lora_" in n]
    assert out_proj and all(packed[n].abs().max() > 0 for n in out_proj)
    assert relative_grad_error(packed, alone_grads) <= 1e-4
