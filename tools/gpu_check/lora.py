"""QLoRA on the GPU (issue 42): a 4-bit bitsandbytes model, PEFT LoRA on every linear layer but the LM head,
``prepare_model_for_kbit_training`` (gradient checkpointing and the input embeddings' ``requires_grad_`` hook),
then ``compilepack.patch``: one graph, 0 breaks, compiled gradients == eager. Needs CUDA and bitsandbytes;
simulated (on CPU) the same recipe runs unquantized."""

from __future__ import annotations

import tempfile

import torch
from transformers import AutoModelForCausalLM

import compilepack
from compilepack.patching import family_named
from compilepack.testing import build_model, varied_batches

from .common import Context, guarded, max_err


def check_qlora(name, ctx: Context):
    """One family's QLoRA recipe, patched: graphs and breaks of the compiled training forward and backward, compiles
    over 4 varied batches (simulated: 2), and the compiled loss and LoRA gradients against the same model run eager."""
    model = guarded({}, lambda: _qlora_model(name, ctx))
    if isinstance(model, dict):  # no bitsandbytes: the reason is the finding
        return {"family": name, **model}
    batches = varied_batches(model.config.get_text_config().vocab_size, 2 if ctx.simulate else 4, seed=2,
                             max_len=60 if ctx.simulate else 600)
    stream = [compilepack.to_device(batch, ctx.device) for batch in batches]
    result = {"family": name, "quantized": not ctx.simulate}
    model.train()
    result["explain_forward_backward"] = guarded({}, lambda: str(compilepack.explain(model, stream[0], backward=True)))
    result["compiled_vs_eager"] = guarded({}, lambda: _compiled_vs_eager(model, stream, ctx.compile_backend))
    return result


def _qlora_model(name, ctx: Context):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = build_model(family_named(name).bench_config(), layers=None, patch=False)
    if not ctx.simulate:
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=torch.bfloat16)
        with tempfile.TemporaryDirectory() as folder:  # bitsandbytes quantizes while loading: save the model first
            model.save_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization,
                                                         device_map={"": ctx.device})
    # patched first: the hook prepare_model_for_kbit_training adds comes guarded
    model = compilepack.patch(model, backend=ctx.chosen())
    model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))


def _compiled_vs_eager(model, stream, compile_backend):
    eager = [_loss_and_grads(model, batch) for batch in stream]
    compiled_model = torch.compile(model, backend=compile_backend, fullgraph=True, dynamic=True)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = [_loss_and_grads(compiled_model, batch, model) for batch in stream]
    return {
        "batches": len(stream), "compiles": torch._dynamo.utils.counters["stats"]["unique_graphs"] - before,
        "max_loss_diff": max(abs(a[0] - b[0]) for a, b in zip(compiled, eager)),
        "max_lora_grad_diff": max(max_err(a[1][k], b[1][k]) for a, b in zip(compiled, eager) for k in b[1]),
        "lora_grads": len(eager[0][1]),
    }


def _loss_and_grads(call, batch, model=None):
    model = model or call
    loss = call(**batch).loss  # the collator's labels are in the batch
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads
