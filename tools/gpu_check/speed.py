"""Section 7 of the GPU check: tokens/s of patched compiled vs stock on the same batches."""

from __future__ import annotations

import copy
import random
import time

import torch
from transformers import AutoModelForCausalLM

import compilepack
from compilepack.ops import backends
from compilepack.patching import family_named

from benchmarks.configs import bench_config
from benchmarks.worker import stock_path
from .common import guarded, synchronize, usable_backends
from .compiles import batch_of, documents_of

# ------------------------------------------------------------------------------------------------ speed


def measure_speed(name, device, dtype, steps, tokens_per_step, compile_backend, smoke=False):
    config = bench_config(name)
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)
    patched = compilepack.patch(copy.deepcopy(stock), backend=usable_backends()[0])
    vocab = config.get_text_config().vocab_size
    rng = random.Random(2)
    batches = []
    for i in range(steps + 2):
        lengths = []
        while sum(lengths) < tokens_per_step:
            lengths.append(min(2048, max(8, int(rng.lognormvariate(5.5, 1.0)))))
        docs = documents_of(vocab, lengths, seed=100 + i)
        batches.append((docs, dict(batch_of(docs, device))))
    result = {"family": name, "tokens_per_step": tokens_per_step, "params_m": sum(p.numel() for p in stock.parameters()) / 1e6}
    result["patched_compiled"] = guarded({}, lambda: _throughput(
        torch.compile(patched, fullgraph=True, dynamic=True, backend=compile_backend), patched,
        [b for _, b in batches], device))
    for label, stock_batches in _stock_variants(name, stock, batches, device).items():
        result[label] = guarded({}, lambda sb=stock_batches: {**_throughput(stock, stock, sb, device),
                                                              "stock_path": stock_path(stock, device)})
    return result


def _stock_variants(name, stock, batches, device):
    """What stock can run on the same documents: the HF packed batch (dense mask) for attention-only models,
    right-padded batches otherwise; FA2 padding-free when flash-attn is installed."""
    family = family_named(name)
    attention_only = all(r.global_name == "ALL_ATTENTION_FUNCTIONS" for reps in family.layers.values() for r in reps)
    variants = {}
    if attention_only:
        variants["stock_sdpa_packed"] = [dict(b, use_cache=False) for _, b in batches]
        if backends.is_installed("flash_attn"):
            stock.set_attn_implementation("flash_attention_2")
            variants = {"stock_fa2_padding_free": variants["stock_sdpa_packed"]}
    else:
        variants["stock_padded"] = [_padded(docs, device) for docs, _ in batches]
    return variants


def _padded(docs, device):
    longest = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(docs):
        ids[row, : len(doc)] = torch.tensor(doc)
        mask[row, : len(doc)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device),
            "use_cache": False}


def _throughput(step, model, batches, device):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    for batch in batches[:2]:  # warm-up (and compile)
        step(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    warm_s = time.perf_counter() - start
    real_tokens = sum(int((b["labels"] != -100).sum()) for b in batches[2:])
    start = time.perf_counter()
    for batch in batches[2:]:
        step(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return {"tokens_per_s": real_tokens / elapsed, "warm_up_s": warm_s, "peak_mem_mb": peak}
