"""GPU validation of the kernel paths: one prepared script, one JSON.

    python benchmarks/gpu_check.py --out gpu_check.json                     # on a CUDA machine (< 8 minutes)
    python benchmarks/gpu_check.py --device cpu --smoke --out smoke.json    # the same plumbing on CPU, seconds

(also ``python -m benchmarks gpu-check``; run as a script it finds the checkout's packages itself.)

On CUDA it checks, with whatever kernel libraries are installed (``compilepack.backends.resolve("auto")``):

1. ops: every op with its CUDA backend against the pure-torch reference, forward and input gradients, by the
   flash-attention rule "kernel error <= 2x the same-dtype reference error vs an fp32 reference" (plus a small
   absolute floor), and packed == each document run alone through the same kernel;
2. families: a patched bench model per family in bf16, packed logits vs each document alone, explain
   (graphs/breaks), compiles over 6 varied HF batches, and a compiled (inductor) training step run under
   ``torch.cuda.set_sync_debug_mode("error")``: any device-to-host sync raises and is recorded with its op;
3. speed: tokens/s of patched compiled vs stock on the same HF-collated batches (stock: sdpa with the dense
   packed mask for attention-only models, right-padded batches for hybrids; FA2 padding-free when flash-attn
   is installed).

Every check records its error instead of stopping the run, so one JSON always comes back.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script (python benchmarks/gpu_check.py): import as benchmarks.gpu_check would
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import argparse
import copy
import json
import platform
import random
import time
import traceback

import torch
import transformers
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

import compilepack
from compilepack import backends
from compilepack.ops import (
    causal_conv1d_varlen,
    gated_delta_rule_varlen,
    mamba2_chunk_scan_varlen,
    varlen_attention,
)
from compilepack.patching import family_named

from .configs import bench_config

HEADLINE = ["llama", "qwen3_next", "qwen3_5", "bamba"]
COLLATE = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)


# ------------------------------------------------------------------------------------------------ ops


def _cu(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _seq_idx(lengths, device):
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))[
        None
    ].to(torch.int32)


def _op_cases(device):
    """name -> (make, backend kind). ``make(lengths, dtype)`` returns the op's differentiable inputs (packed),
    the dimension of each that runs over tokens (None: a parameter), and ``call(inputs, lengths, backend)``."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    def attention(lengths, dtype):
        t = sum(lengths)
        tensors = [randn(t, 8, 64, dtype=dtype), randn(t, 2, 64, dtype=dtype), randn(t, 2, 64, dtype=dtype)]
        return tensors, [0, 0, 0], lambda x, ls, b: varlen_attention(*x, _cu(ls, device), max(ls), backend=b)

    def conv(lengths, dtype):
        t = sum(lengths)
        tensors = [randn(1, t, 256, dtype=dtype).transpose(1, 2), randn(256, 4, dtype=dtype, scale=0.5),
                   randn(256, dtype=dtype)]
        return tensors, [2, None, None], lambda x, ls, b: causal_conv1d_varlen(
            *x, _seq_idx(ls, device), "silu", backend=b)

    def gated_delta(lengths, dtype):
        t = sum(lengths)
        tensors = [
            randn(1, t, 4, 64, dtype=dtype), randn(1, t, 4, 64, dtype=dtype), randn(1, t, 8, 64, dtype=dtype),
            (-torch.rand(1, t, 8, generator=gen) * 0.5).to(device=device, dtype=torch.float32),
            torch.rand(1, t, 8, generator=gen).to(device=device, dtype=dtype),
        ]
        return tensors, [1] * 5, lambda x, ls, b: gated_delta_rule_varlen(*x, _cu(ls, device), backend=b)

    def ssd(lengths, dtype):
        t = sum(lengths)
        tensors = [
            randn(1, t, 8, 64, dtype=dtype), randn(1, t, 8, dtype=dtype, scale=0.5),
            (-torch.rand(8, generator=gen) - 0.5).to(device=device, dtype=torch.float32),
            randn(1, t, 1, 64, dtype=dtype), randn(1, t, 1, 64, dtype=dtype),
            torch.ones(8, device=device), torch.zeros(8, device=device),
        ]

        def call(x, ls, b):
            xs, dt, A, B, C, D, dt_bias = x
            return mamba2_chunk_scan_varlen(xs, dt, A, B, C, 64, D=D, dt_bias=dt_bias, dt_softplus=True,
                                            seq_idx=_seq_idx(ls, device), backend=b)

        return tensors, [1, 1, None, 1, 1, None, None], call

    return {"varlen_attention": (attention, "attention"), "causal_conv1d_varlen": (conv, "conv"),
            "gated_delta_rule_varlen": (gated_delta, "gated_delta"), "mamba2_chunk_scan_varlen": (ssd, "ssd")}


def _run(call, tensors, lengths, backend, dtype=None):
    """Output and input gradients (fp32 copies) of one call; ``dtype`` casts the float inputs first."""
    inputs = [(t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().requires_grad_()
              for t in tensors]
    out = call(inputs, lengths, backend)
    grad = torch.ones_like(out) / out.numel() ** 0.5
    grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    return out.float(), [None if g is None else g.float() for g in grads]


def _max_err(a, b):
    return (a - b).abs().max().item()


def check_op(name, make, kind, chosen, dtype, lengths):
    backend = getattr(chosen, kind)
    result = {"op": name, "backend": backend, "dtype": str(dtype), "lengths": lengths}
    tensors, token_dims, call = make(lengths, dtype)
    kernel, kernel_grads = _run(call, tensors, lengths, backend)
    same_dtype, same_dtype_grads = _run(call, tensors, lengths, backends.REFERENCE)
    fp32, fp32_grads = _run(call, tensors, lengths, backends.REFERENCE, dtype=torch.float32)
    kernel_err, ref_err = _max_err(kernel, fp32), _max_err(same_dtype, fp32)
    result["out"] = {"kernel_vs_fp32": kernel_err, "reference_same_dtype_vs_fp32": ref_err}
    ok = kernel_err <= 2 * ref_err + 1e-5
    result["grads"] = []
    for g, r, f in zip(kernel_grads, same_dtype_grads, fp32_grads):
        if g is None or f is None:
            continue
        entry = {"kernel_vs_fp32": _max_err(g, f), "reference_same_dtype_vs_fp32": _max_err(r, f)}
        ok &= entry["kernel_vs_fp32"] <= 2 * entry["reference_same_dtype_vs_fp32"] + 1e-5
        result["grads"].append(entry)
    result["packed_vs_alone_same_kernel"] = _packed_vs_alone(call, tensors, token_dims, lengths, backend, kernel)
    result["ok"] = bool(ok)
    return result


def _packed_vs_alone(call, tensors, token_dims, lengths, backend, packed):
    """The same kernel on each document's slice of the same inputs, compared with the packed output."""
    error, start = 0.0, 0
    out_dim = token_dims[0]
    for n in lengths:
        pieces = [t if d is None else t.narrow(d, start, n) for t, d in zip(tensors, token_dims)]
        alone, _ = _run(call, pieces, [n], backend)
        error = max(error, _max_err(packed.narrow(out_dim, start, n), alone))
        start += n
    return error


def check_ops(device, dtype, lengths):
    chosen = backends.resolve("auto")
    results = []
    for name, (make, kind) in _op_cases(device).items():
        results.append(_guarded({"op": name}, lambda: check_op(name, make, kind, chosen, dtype, lengths)))
    return results


# ------------------------------------------------------------------------------------------------ families


def _docs(vocab, lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def _batch(docs, device):
    batch = COLLATE([{"input_ids": d} for d in docs])
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _lengths(rng, count, low, high):
    return [rng.randint(low, high) for _ in range(count)]


def check_family(name, device, dtype, smoke, compile_backend):
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(bench_config(name)).to(device=device, dtype=dtype).eval()
    patched = compilepack.patch(copy.deepcopy(stock))
    vocab = stock.config.get_text_config().vocab_size
    rng = random.Random(1)
    result = {"family": name, "backends": compilepack.patching.patch_state(patched).backends.describe()}
    docs = _docs(vocab, [70, 1, 23, 5, 40] if smoke else [700, 1, 230, 64, 1500], seed=0)
    batch = _batch(docs, device)

    def packed_vs_alone():
        with torch.no_grad():
            packed = patched(**batch).logits[0].float()
            cu = batch["cu_seq_lens_q"].tolist()
            alone = [patched(**_batch([d], device)).logits[0].float() for d in docs]
        return max(_max_err(packed[s:e], a) for s, e, a in zip(cu[:-1], cu[1:], alone))

    result["max_logit_diff_packed_vs_alone"] = _guarded({}, packed_vs_alone)
    result["explain_forward"] = _guarded({}, lambda: str(compilepack.explain(patched, batch, reset=True)))
    stream = [_batch(_docs(vocab, _lengths(rng, rng.randint(1, 6), 1, 300), seed=i), device) for i in range(6)]
    result["compiles_over_6_batches"] = _guarded({}, lambda: compilepack.count_compiles(patched, stream, reset=True).compiles)
    result["compiled_training_step"] = _guarded(
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
    _synchronize(device)
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


# ------------------------------------------------------------------------------------------------ speed


def measure_speed(name, device, dtype, steps, tokens_per_step, compile_backend, smoke=False):
    config = bench_config(name)
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)
    patched = compilepack.patch(copy.deepcopy(stock))
    vocab = config.get_text_config().vocab_size
    rng = random.Random(2)
    batches = []
    for i in range(steps + 2):
        lengths = []
        while sum(lengths) < tokens_per_step:
            lengths.append(min(2048, max(8, int(rng.lognormvariate(5.5, 1.0)))))
        docs = _docs(vocab, lengths, seed=100 + i)
        batches.append((docs, dict(_batch(docs, device))))
    result = {"family": name, "tokens_per_step": tokens_per_step, "params_m": sum(p.numel() for p in stock.parameters()) / 1e6}
    result["patched_compiled"] = _guarded({}, lambda: _throughput(
        torch.compile(patched, fullgraph=True, dynamic=True, backend=compile_backend), patched,
        [b for _, b in batches], device))
    for label, stock_batches in _stock_variants(name, stock, batches, device).items():
        result[label] = _guarded({}, lambda sb=stock_batches: _throughput(stock, stock, sb, device))
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
    _synchronize(device)
    warm_s = time.perf_counter() - start
    real_tokens = sum(int((b["labels"] != -100).sum()) for b in batches[2:])
    start = time.perf_counter()
    for batch in batches[2:]:
        step(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return {"tokens_per_s": real_tokens / elapsed, "warm_up_s": warm_s, "peak_mem_mb": peak}


# ------------------------------------------------------------------------------------------------ plumbing


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _guarded(context, check):
    try:
        return check()
    except Exception as error:  # a check that fails is a finding: record it and go on
        return {**context, "error": "".join(traceback.format_exception_only(error)).strip()[-800:]}


def environment(device):
    info = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "compilepack": compilepack.__version__, "device": str(device),
        "installed": {name: backends.is_installed(name) for name in ("flash_attn", "torch_varlen", "fla",
                                                                         "mamba_ssm", "causal_conv1d")},
        "auto_backends": backends.resolve("auto").describe(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--families", default=",".join(HEADLINE), help="comma list, or 'all'")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: exercise the plumbing in seconds")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (smoke: eager)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = [f.name for f in compilepack.families()] if args.families == "all" else args.families.split(",")
    started = time.perf_counter()
    report = {"environment": environment(device)}
    report["ops"] = check_ops(device, dtype, [5, 1, 70] if args.smoke else [300, 1, 64, 1024, 17, 700])
    backend = "eager" if args.smoke else args.compile_backend
    report["families"] = [_guarded({"family": n}, lambda n=n: check_family(n, device, dtype, args.smoke, backend))
                          for n in names]
    steps, tokens = (2, 512) if args.smoke else (8, 16384)
    report["speed"] = [_guarded({"family": n}, lambda n=n: measure_speed(n, device, dtype, steps, tokens, backend, args.smoke))
                       for n in names]
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
