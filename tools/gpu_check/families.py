"""The GPU check's first section: per family, stock beside patched in one run, on the same documents (speed,
compiles, a sync-free compiled step, packed logits vs each document alone, ``explain``; docs/benchmarks.md)."""

from __future__ import annotations

import copy
import random
import time

import torch

import compilepack
from compilepack.batch.keys import HOST_BOUNDARY_KEYS
from compilepack.ops import backends
from compilepack.patching import family_named
from compilepack.testing import build_model, packed_batch, padded_batch, stock_path
from compilepack.testing.batches import random_documents

from .common import Context, auto_outcome, describe, guarded, max_err, synchronize


def batch_of(docs, device, boundaries_on_device=False):
    """The HF collator's packed batch on ``device``, its boundaries on the host (as ``compilepack.to_device`` leaves
    them: the patched model moves them itself and keeps the host copy) unless ``boundaries_on_device``."""
    batch = compilepack.to_device(packed_batch(docs).batch, device)
    if boundaries_on_device:
        batch.update({key: batch[key].to(device) for key in HOST_BOUNDARY_KEYS})
    return batch


def speed_batches(vocab, steps, tokens_per_step, device):
    """``steps + 2`` batches of lognormal documents (the first two warm up): (documents, packed batch)."""
    rng = random.Random(2)
    batches = []
    for i in range(steps + 2):
        lengths = []
        while sum(lengths) < tokens_per_step:
            lengths.append(min(2048, max(8, int(rng.lognormvariate(5.5, 1.0)))))
        docs = random_documents(random.Random(100 + i), vocab, lengths)
        batches.append((docs, batch_of(docs, device)))
    return batches


def check_family(name: str, ctx: Context) -> tuple[dict, dict]:
    """(the family's speed row, its checks)."""
    start = time.perf_counter()
    stock = build_model(family_named(name).bench_config(), layers=None, patch=False).to(ctx.device, ctx.dtype)
    auto = auto_outcome(copy.deepcopy(stock))
    patched = compilepack.patch(copy.deepcopy(stock), backend=ctx.chosen())
    vocab = stock.config.get_text_config().vocab_size
    steps, tokens = (1, 256) if ctx.simulate else (8, 16384)
    batches = speed_batches(vocab, steps, tokens, ctx.device)
    speed = {"family": name, "tokens_per_step": tokens, "params_m": sum(p.numel() for p in stock.parameters()) / 1e6}
    checks = {"family": name, "patch_auto": auto,
              "backends": compilepack.patching.patch_state(patched).backends.describe()}
    step = torch.compile(patched, fullgraph=True, dynamic=True, backend=ctx.compile_backend)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    speed["patched_compiled"] = guarded({}, lambda: throughput(step, patched, [b for _, b in batches], ctx.device))
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    checks["compiles_over_batches"] = {"batches": len(batches), "compiles": compiles} if (
        "error" not in speed["patched_compiled"]) else {"error": "the compiled steps failed (speed.patched_compiled)"}
    checks["compiled_training_step"] = guarded({}, lambda: sync_free_steps(step, patched, batches, ctx))
    for label, stock_batches in stock_variants(name, stock, batches, ctx.device).items():
        speed[label] = guarded({}, lambda sb=stock_batches: {**throughput(stock, stock, sb, ctx.device),
                                                              "stock_path": stock_path(stock, ctx.device)})
    checks["stock_path"] = stock_path(stock, ctx.device)
    docs = random_documents(random.Random(0), vocab, [70, 1, 23, 5, 40] if ctx.simulate else [700, 1, 230, 64, 1500])
    checks["max_logit_diff_packed_vs_alone"] = guarded({}, lambda: packed_vs_alone(patched, docs, ctx.device))
    checks["explain_forward"] = guarded({}, lambda: str(compilepack.explain(patched, batch_of(docs, ctx.device))))
    checks["wall_s"] = round(time.perf_counter() - start, 1)
    return speed, checks


def packed_vs_alone(model, docs, device):
    batch = batch_of(docs, device)
    with torch.no_grad():
        packed = model(**batch).logits[0].float()
        alone = [model(**batch_of([d], device)).logits[0].float() for d in docs]
    cu = batch["cu_seq_lens_q"].tolist()  # on the host: no sync
    return max(max_err(packed[s:e], a) for s, e, a in zip(cu[:-1], cu[1:], alone))


def sync_free_steps(step, model, batches, ctx: Context):
    """The compiled step again on two of its batches (simulated: one) under CUDA's sync debug mode set to error,
    boundaries on the host (the recipe); beside it on the device, as HF Trainer moves them, compiled with dynamo
    alone ("eager": the syncs are the ops', and a second inductor compile per family would not fit the lease)."""
    result = {}
    for label, on_device in (("host_boundaries", False), ("device_boundaries", True)):
        runs = [batch_of(docs, ctx.device, on_device) for docs, _ in batches[: 1 if ctx.simulate else 2]]
        compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="eager") if on_device else step
        backend = {"compile_backend": "eager" if on_device else ctx.compile_backend}
        result[label] = guarded(backend, lambda r=runs, c=compiled, b=backend: {
            **b, **_steps_without_syncs(c, model, r, ctx.device)})
    result["sync_free"] = result["host_boundaries"].get("sync_free")  # the recipe's verdict (None: not on CUDA)
    return result


def _steps_without_syncs(step, model, batches, device):
    model.train()
    for batch in batches:  # warm: compiles happen outside the check
        step(**batch).loss.backward()
    synchronize(device)
    cuda, error = torch.device(device).type == "cuda", None
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    start = time.perf_counter()
    try:
        for batch in batches:
            step(**batch).loss.backward()
    except RuntimeError as raised:
        error = describe(raised)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    synchronize(device)
    model.zero_grad(set_to_none=True)
    return {"sync_free": (error is None) if cuda else None, "sync_error": error,
            "steps_s": round(time.perf_counter() - start, 3)}


def stock_variants(name, stock, batches, device):
    """What stock can train on the same documents: the packed batch (dense mask) for attention-only models,
    right-padded rows otherwise; FA2 padding-free when flash-attn is installed."""
    if not family_named(name).stock_packs_positions:  # not attention-only
        return {"stock_padded": [{**compilepack.to_device(padded_batch(docs), device), "use_cache": False}
                                 for docs, _ in batches]}
    packed = [dict(batch_of(docs, device, True), use_cache=False) for docs, _ in batches]
    if backends.is_installed("flash_attn") and torch.device(device).type == "cuda":
        stock.set_attn_implementation("flash_attention_2")
        return {"stock_fa2_padding_free": packed}
    return {"stock_sdpa_packed": packed}


def throughput(step, model, batches, device):
    """Training steps with AdamW: the first two warm up (and compile), the rest are timed."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train(stream):
        start = time.perf_counter()
        for batch in stream:
            step(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        return time.perf_counter() - start

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warm_s = train(batches[:2])
    elapsed = train(batches[2:])
    real_tokens = sum(int((b["labels"] != -100).sum()) for b in batches[2:])
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.device(device).type == "cuda" else None
    return {"tokens_per_s": real_tokens / elapsed, "warm_up_s": warm_s, "steps_s": elapsed, "peak_mem_mb": peak}
