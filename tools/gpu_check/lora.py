"""QLoRA on the GPU (issue 42): a 4-bit bitsandbytes model, PEFT LoRA on every linear layer but the LM head,
``prepare_model_for_kbit_training`` (gradient checkpointing and the input embeddings' ``requires_grad_`` hook),
then ``compilepack.patch``: one graph, 0 breaks, compiled gradients == eager. Needs CUDA and bitsandbytes: the GPU
check's ``qlora`` section (``run.py``) calls ``check_qlora(name, device, compile_backend)`` per family."""

from __future__ import annotations

import random
import tempfile

import torch
from transformers import AutoModelForCausalLM

import compilepack

from benchmarks.configs import bench_config
from .common import guarded, max_err
from .compiles import batch_of, documents_of


def check_qlora(name, device, compile_backend="inductor"):
    """One family's QLoRA recipe, patched: graphs and breaks of the compiled training forward, compiles over 4
    varied batches, and the compiled loss and LoRA gradients against the same model run eager."""
    if torch.device(device).type != "cuda":
        return {"family": name, "skipped": "CUDA only"}  # bitsandbytes' 4-bit layers
    model = guarded({}, lambda: _qlora_model(name, device))
    if isinstance(model, dict):  # no bitsandbytes, no CUDA: the reason is the finding
        return {"family": name, **model}
    vocab = model.config.get_text_config().vocab_size
    rng = random.Random(2)
    stream = [batch_of(documents_of(vocab, [rng.randint(1, 600) for _ in range(rng.randint(1, 6))], seed=i), device)
              for i in range(4)]
    result = {"family": name}
    model.train()
    result["explain_forward_train_mode"] = guarded({}, lambda: str(compilepack.explain(model, stream[0], reset=True)))
    result["explain_forward_backward"] = guarded(
        {}, lambda: str(compilepack.explain(model, stream[0], backward=True, reset=True)))
    result["compiled_vs_eager"] = guarded({}, lambda: _compiled_vs_eager(model, stream, compile_backend))
    return result


def _qlora_model(name, device):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    torch.manual_seed(0)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                       bnb_4bit_compute_dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:  # bitsandbytes quantizes while loading: save a random model first
        AutoModelForCausalLM.from_config(bench_config(name)).save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map={"": device})
    model = compilepack.patch(model)  # first: the hook prepare_model_for_kbit_training adds comes guarded
    model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    config = LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, config)


def _compiled_vs_eager(model, stream, compile_backend):
    eager = [_loss_and_grads(model, batch) for batch in stream]
    compiled_model = torch.compile(model, backend=compile_backend, fullgraph=True, dynamic=True)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = [_loss_and_grads(compiled_model, batch, model) for batch in stream]
    return {
        "compiles_over_4_batches": torch._dynamo.utils.counters["stats"]["unique_graphs"] - before,
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
