"""Sections 4-5 of the GPU check: recompiles of the Triton kernels over varied batches, and each family's patched
model (exactness, graphs, compiles, a sync-free compiled training step)."""

from __future__ import annotations

import copy
import random
import sys
import time
import traceback

import torch
from transformers import AutoModelForCausalLM

import compilepack

from benchmarks.configs import bench_config
from benchmarks.worker import stock_path
from .common import COLLATE, guarded, max_err, op_cases, run_op, synchronize, usable_backends
from .ops import kernel_paths

# ------------------------------------------------------------------------------------------------ recompiles


def _triton_kernels(prefixes=("fla.", "mamba_ssm.")):
    """Every Triton kernel the kernel libraries define, by name: (JIT function, the autotuners around it)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    found = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(prefixes):
            continue
        for value in list(vars(module).values()):
            tuners, fn = [], value
            for _ in range(4):  # Autotuner / Heuristics wrappers hold the JIT function in .fn
                if isinstance(fn, JITFunction) or not hasattr(fn, "fn"):
                    break
                if isinstance(getattr(fn, "cache", None), dict):
                    tuners.append(fn)
                fn = fn.fn
            if isinstance(fn, JITFunction):
                found[f"{fn.__module__}.{fn.__name__}"] = (fn, tuners)
    return found


def _cache_sizes(kernels) -> dict[str, tuple[int, int]]:
    """Per kernel: (compiled variants, autotuned keys)."""
    sizes = {}
    for name, (fn, tuners) in kernels.items():
        caches = getattr(fn, "device_caches", {})
        variants = sum(len(entry[0]) for entry in caches.values()) if isinstance(caches, dict) else 0
        sizes[name] = (variants, sum(len(t.cache) for t in tuners))
    return sizes


def _varied_batches(seed, count):
    rng = random.Random(seed)
    batches = []
    for _ in range(count):
        rows = rng.choice([1, 2])
        per_row = []
        for _ in range(rows):
            row = [rng.randint(1, 700) for _ in range(rng.randint(1, 6))]
            row.insert(rng.randint(1, len(row)), 0)  # an empty document after the first (in the middle or at the end)
            per_row.append(row)
        length = max(sum(row) for row in per_row)
        for row in per_row:
            row[0] += length - sum(row)  # rows of one length
        batches.append(([n for row in per_row for n in row], rows))
    return batches


def check_recompiles(device, dtype, smoke):
    """After one warm-up batch, 6 batches of new lengths, document counts and rows through each Triton op, forward
    and backward: the JIT variants and autotuning runs they add, per kernel. Dynamo's own recompiles are counted per
    family (``compiles_over_6_batches``)."""
    if device.type != "cuda":
        return {"skipped": "CUDA only"}
    cases = op_cases(device)
    paths = [(op, b) for op, b in kernel_paths(device) if b in ("fla", "mamba_ssm")]
    if not paths:
        return {"skipped": "no Triton kernel library installed"}
    results = {}
    for op, backend in paths:
        make = cases[op][0]
        warm = _varied_batches(0, 1)
        stream = _varied_batches(1, 2 if smoke else 6)
        for lengths, rows in warm:
            tensors, _, call = make(lengths, rows, dtype)
            run_op(call, tensors, lengths, rows, backend)
        before = _cache_sizes(_triton_kernels())
        for lengths, rows in stream:
            tensors, _, call = make(lengths, rows, dtype)
            run_op(call, tensors, lengths, rows, backend)
        synchronize(device)
        after = _cache_sizes(_triton_kernels())
        new_variants = {k: after[k][0] - before.get(k, (0, 0))[0] for k in after if after[k][0] > before.get(k, (0, 0))[0]}
        new_tunes = {k: after[k][1] - before.get(k, (0, 0))[1] for k in after if after[k][1] > before.get(k, (0, 0))[1]}
        results[f"{op}/{backend}"] = {
            "batches": [{"lengths": lengths, "rows": rows} for lengths, rows in stream],
            "kernels_after_warmup": sum(1 for v in before.values() if v[0]),
            "new_jit_variants": new_variants, "new_autotune_runs": new_tunes,
            "ok": not new_variants and not new_tunes,
        }
    return results


# ------------------------------------------------------------------------------------------------ families


def documents_of(vocab, lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def batch_of(docs, device):
    batch = COLLATE([{"input_ids": d} for d in docs])
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _lengths(rng, count, low, high):
    return [rng.randint(low, high) for _ in range(count)]


def check_family(name, device, dtype, smoke, compile_backend):
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(bench_config(name)).to(device=device, dtype=dtype).eval()
    patched = compilepack.patch(copy.deepcopy(stock), backend=usable_backends()[0])
    vocab = stock.config.get_text_config().vocab_size
    rng = random.Random(1)
    result = {"family": name, "backends": compilepack.patching.patch_state(patched).backends.describe(),
              "stock_path": stock_path(stock, device)}
    docs = documents_of(vocab, [70, 1, 23, 5, 40] if smoke else [700, 1, 230, 64, 1500], seed=0)
    batch = batch_of(docs, device)

    def packed_vs_alone():
        with torch.no_grad():
            packed = patched(**batch).logits[0].float()
            cu = batch["cu_seq_lens_q"].tolist()
            alone = [patched(**batch_of([d], device)).logits[0].float() for d in docs]
        return max(max_err(packed[s:e], a) for s, e, a in zip(cu[:-1], cu[1:], alone))

    result["max_logit_diff_packed_vs_alone"] = guarded({}, packed_vs_alone)
    result["explain_forward"] = guarded({}, lambda: str(compilepack.explain(patched, batch, reset=True)))
    stream = [batch_of(documents_of(vocab, _lengths(rng, rng.randint(1, 6), 1, 300), seed=i), device) for i in range(6)]
    result["compiles_over_6_batches"] = guarded({}, lambda: compilepack.count_compiles(patched, stream, reset=True).compiles)
    result["compiled_training_step"] = guarded(
        {}, lambda: _sync_free_training_step(patched, stream, device, compile_backend))
    return result


def _sync_free_training_step(model, stream, device, compile_backend):
    """Compile (fullgraph, dynamic), warm up on every batch, then run them again with CUDA's sync debug mode
    set to error: a device-to-host sync anywhere in the step raises."""
    model.train()
    step = torch.compile(model, fullgraph=True, dynamic=True, backend=compile_backend)
    start = time.perf_counter()
    for batch in stream:
        step(**batch).loss.backward()
    synchronize(device)
    warm_s = time.perf_counter() - start
    sync_error = None
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in stream:
            step(**batch).loss.backward()
    except RuntimeError as error:
        sync_error = "".join(traceback.format_exception_only(error)).strip()[-600:]
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    model.zero_grad(set_to_none=True)
    model.eval()
    # sync-debug mode exists only on CUDA: elsewhere the step ran but nothing was checked
    sync_free = (sync_error is None) if device.type == "cuda" else None
    return {"warm_up_s": warm_s, "sync_free": sync_free, "sync_error": sync_error}
