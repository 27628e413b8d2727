"""GPU validation of the kernel paths: one prepared script, one JSON.

    python benchmarks/gpu_check.py --out gpu_check.json                     # on a CUDA machine (< 10 minutes)
    python benchmarks/gpu_check.py --device cpu --smoke --out smoke.json    # the same plumbing on CPU, seconds

(also ``python -m benchmarks gpu-check``; run as a script it finds the checkout's packages itself.)

On CUDA it checks, with whatever kernel libraries are installed (``compilepack.backends``), in this order, each
section only while the time budget (``--budget-s``, 480 s: a section started may run on) lasts:

1. ops: every op with its CUDA backend against the pure-torch reference, forward and input gradients, by the
   flash-attention rule "kernel error <= 2x the same-dtype reference error vs an fp32 reference" or an error
   within the dtype's tolerance, and packed == each document run alone through the same kernel;
2. layouts: every kernel path (flash-attn and torch's varlen attention, causal-conv1d, fla's gated delta rule and
   Kimi delta attention, mamba-ssm's SSD scan) on the layouts of the reported varlen bugs (docs/kernels.md):
   1-token documents, chunk size +-1, zero-length documents in the middle and at the end, a padding-only document,
   two rows, the fixed-shape collator's layout; finite outputs and gradients within tolerance of fp32;
3. known bugs: each reported bug's trigger on the library alone and on compilepack's guarded path (flash-attn
   #1537 in both attention kernels; causal-conv1d #117 and fla #892 in a child process, since the library alone
   may fault);
4. recompiles: a stream of varied batches through the Triton ops after one warm-up batch: new JIT variants and
   new autotuning runs per kernel (fla's and mamba-ssm's own caches);
5. families: a patched bench model per family in bf16, packed logits vs each document alone, explain
   (graphs/breaks), compiles over 6 varied HF batches, and a compiled (inductor) training step run under
   ``torch.cuda.set_sync_debug_mode("error")``: any device-to-host sync raises and is recorded with its op;
6. long rows: rows near the int32 limits the bugs name (mamba #1015/#1036, causal-conv1d #114; fla and flash-attn
   index in int64), where memory allows, each in a child process: the last document of a long row vs the same
   document alone, on the guarded path just below and just above the limit and on the library alone above it;
7. speed: tokens/s of patched compiled vs stock on the same HF-collated batches (stock: sdpa with the dense
   packed mask for attention-only models, right-padded batches for hybrids; FA2 padding-free when flash-attn
   is installed), each stock result naming the path stock ran (``stock_path``).

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
import os
import platform
import random
import subprocess
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

import compilepack
from compilepack import backends
from compilepack.boundaries import seq_idx_from_cu_seqlens
from compilepack.ops import (
    causal_conv1d_varlen,
    gated_delta_rule_varlen,
    kimi_delta_attention_varlen,
    mamba2_chunk_scan_varlen,
    varlen_attention,
)
from compilepack.patching import family_named

from .configs import bench_config
from .worker import stock_path

HEADLINE = ["llama", "qwen3_next", "qwen3_5", "bamba"]
COLLATE = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
SCRIPT = Path(__file__).resolve()
KERNEL_BACKENDS = ("flash_attn", "torch_varlen", "causal_conv1d", "fla", "mamba_ssm")
# largest error against the fp32 reference, relative to the largest fp32 entry, accepted per dtype
TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-8}

# the kernel stage's layouts (tests/kernels) at GPU sizes: name -> (document lengths, rows)
LAYOUTS = {
    "one-token-docs": ([1, 1, 5, 1, 1, 7], 1),
    "chunk-size-pm-1": ([63, 65, 64, 127, 129, 255, 257], 1),
    "zero-length": ([200, 0, 300, 0, 57, 0, 0], 1),
    "padding-document": ([120, 1, 391], 1),
    "two-rows": ([300, 212, 400, 112], 2),
    "packed-collator": ([1, 0, 65, 1, 16, 30, 1, 52, 0, 0], 2),
}
SMOKE_LAYOUTS = ("zero-length", "packed-collator")
PADDING_DOCUMENT = {"padding-document": 2, "packed-collator": 7}  # the padding-only document of a layout


class Budget:
    """The run's time budget: a section starts only with ``needs_s`` seconds left."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def run(self, needs_s: float, check, context=None):
        if self.left() < needs_s:
            return {**(context or {}), "skipped": f"time budget: {self.left():.0f} s left, needs {needs_s:.0f} s"}
        return _guarded(context or {}, check)


# ------------------------------------------------------------------------------------------------ inputs


def _cu(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _seq_idx(lengths, device, rows=1):
    """Document index per token, ``[rows, T / rows]``, as the patch derives it (a zero-length document leaves a gap)."""
    return seq_idx_from_cu_seqlens(_cu(lengths, device), sum(lengths)).view(rows, -1)


def _as_padding(tokens, lengths, layout):
    """The layout's padding-only document made of identical tokens: its first token's values repeated
    (``tokens`` token-major, ``[rows * T or T, ...]`` contiguous views)."""
    index = PADDING_DOCUMENT.get(layout)
    if index is not None:
        start, end = sum(lengths[:index]), sum(lengths[: index + 1])
        for t in tokens:
            t[start:end] = t[start]


def _op_cases(device):
    """name -> (make, backend kind). ``make(lengths, rows, dtype, layout)`` returns the op's differentiable inputs,
    the dimension of each that runs over tokens (None: a parameter; meaningful for one row) and ``call(inputs,
    lengths, rows, backend)``."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    def on(tensors, dtypes):
        return [t.to(device=device, dtype=d) for t, d in zip(tensors, dtypes)]

    def attention(lengths, rows, dtype, layout=None):
        t = sum(lengths)
        tokens = [randn(t, 8, 64), randn(t, 2, 64), randn(t, 2, 64)]
        _as_padding(tokens, lengths, layout)

        def call(x, ls, rows, b):
            return varlen_attention(*x, _cu(ls, device), max(max(ls), 1), backend=b)

        return on(tokens, [dtype] * 3), [0, 0, 0], call

    def conv(lengths, rows, dtype, layout=None):
        t = sum(lengths)
        x = randn(t, 256)
        _as_padding([x], lengths, layout)
        x = x.view(rows, t // rows, 256).transpose(1, 2)  # channel-last, as transformers passes it
        tensors = on([x, randn(256, 4, scale=0.5), randn(256)], [dtype] * 3)

        def call(x, ls, rows, b):
            return causal_conv1d_varlen(*x, _seq_idx(ls, device, rows), "silu", backend=b)

        return tensors, [2, None, None], call

    def delta_rule(per_channel):
        def make(lengths, rows, dtype, layout=None):
            t = sum(lengths)
            decay = F.logsigmoid(randn(t, 8, 64) + 3) if per_channel else -torch.rand(t, 8, generator=gen) * 0.5
            tokens = [randn(t, 4, 64), randn(t, 4, 64), randn(t, 8, 64), decay, torch.rand(t, 8, generator=gen)]
            _as_padding(tokens, lengths, layout)
            shaped = [x.view(rows, t // rows, *x.shape[1:]) for x in tokens]
            function = kimi_delta_attention_varlen if per_channel else gated_delta_rule_varlen

            def call(x, ls, rows, b):
                cu = _cu(ls, device)
                return function(*x, cu, use_qk_l2norm=True, cu_seqlens_cpu=cu.cpu(), backend=b)

            return on(shaped, [dtype, dtype, dtype, torch.float32, dtype]), [1] * 5, call

        return make

    def ssd(lengths, rows, dtype, layout=None):
        t = sum(lengths)
        tokens = [randn(t, 8, 64), randn(t, 8, scale=0.5), randn(t, 1, 64), randn(t, 1, 64)]
        _as_padding(tokens, lengths, layout)
        x, dt, B, C = (v.view(rows, t // rows, *v.shape[1:]) for v in tokens)
        A = -torch.rand(8, generator=gen) - 0.5
        tensors = on([x, dt, A, B, C, torch.ones(8), torch.zeros(8)],
                     [dtype, dtype, torch.float32, dtype, dtype, torch.float32, torch.float32])

        def call(x, ls, rows, b):
            xs, dt, A, B, C, D, dt_bias = x
            return mamba2_chunk_scan_varlen(xs, dt, A, B, C, 64, D=D, dt_bias=dt_bias, dt_softplus=True,
                                            seq_idx=_seq_idx(ls, device, rows), backend=b)

        return tensors, [1, 1, None, 1, 1, None, None], call

    return {"varlen_attention": (attention, "attention"), "causal_conv1d_varlen": (conv, "conv"),
            "gated_delta_rule_varlen": (delta_rule(False), "gated_delta"),
            "kimi_delta_attention_varlen": (delta_rule(True), "gated_delta"),
            "mamba2_chunk_scan_varlen": (ssd, "ssd")}


def _run(call, tensors, lengths, rows, backend, dtype=None):
    """Output and input gradients (fp32 copies) of one call; ``dtype`` casts the float inputs first."""
    inputs = [(t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().requires_grad_()
              for t in tensors]
    out = call(inputs, lengths, rows, backend)
    grad = torch.ones_like(out) / out.numel() ** 0.5
    grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    return out.float(), [None if g is None else g.float() for g in grads]


def _max_err(a, b):
    return (a - b).abs().max().item()


def _relative(a, b):
    """Largest |a - b| relative to the largest |b| (at least 1e-6)."""
    return _max_err(a, b) / max(b.abs().max().item(), 1e-6)


def _finite(*tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


# ------------------------------------------------------------------------------------------------ ops


def check_op(name, make, kind, chosen, dtype, lengths):
    backend = getattr(chosen, kind)
    result = {"op": name, "backend": backend, "dtype": str(dtype), "lengths": lengths}
    tensors, token_dims, call = make(lengths, 1, dtype)
    kernel, kernel_grads = _run(call, tensors, lengths, 1, backend)
    same_dtype, same_dtype_grads = _run(call, tensors, lengths, 1, backends.REFERENCE)
    fp32, fp32_grads = _run(call, tensors, lengths, 1, backends.REFERENCE, dtype=torch.float32)
    kernel_err, ref_err = _max_err(kernel, fp32), _max_err(same_dtype, fp32)
    result["out"] = {"kernel_vs_fp32": kernel_err, "reference_same_dtype_vs_fp32": ref_err,
                     "relative": _relative(kernel, fp32)}
    # the references compute in fp32 whatever their inputs, so their "same dtype" error is only the output's
    # rounding: a kernel that computes in bf16 passes by the dtype's tolerance instead
    tolerance = TOLERANCE[dtype]
    ok = kernel_err <= 2 * ref_err + 1e-5 or result["out"]["relative"] <= tolerance
    result["grads"] = []
    for g, r, f in zip(kernel_grads, same_dtype_grads, fp32_grads):
        if g is None or f is None:
            continue
        entry = {"kernel_vs_fp32": _max_err(g, f), "reference_same_dtype_vs_fp32": _max_err(r, f),
                 "relative": _relative(g, f)}
        ok &= entry["kernel_vs_fp32"] <= 2 * entry["reference_same_dtype_vs_fp32"] + 1e-5 or (
            entry["relative"] <= tolerance)
        result["grads"].append(entry)
    result["packed_vs_alone_same_kernel"] = _packed_vs_alone(call, tensors, token_dims, lengths, backend, kernel)
    result["ok"] = bool(ok and _finite(kernel, *kernel_grads))
    return result


def _packed_vs_alone(call, tensors, token_dims, lengths, backend, packed):
    """The same kernel on each document's slice of the same inputs, compared with the packed output."""
    error, start = 0.0, 0
    out_dim = token_dims[0]
    for n in lengths:
        if n == 0:
            continue
        pieces = [t if d is None else t.narrow(d, start, n) for t, d in zip(tensors, token_dims)]
        alone, _ = _run(call, pieces, [n], 1, backend)
        error = max(error, _max_err(packed.narrow(out_dim, start, n), alone))
        start += n
    return error


def check_ops(device, dtype, lengths):
    try:
        chosen = backends.resolve("auto")
    except backends.KernelVersionError as refusal:  # a library below its floor: the finding, and nothing to run
        return [{"error": _describe(refusal)}]
    results = []
    for name, (make, kind) in _op_cases(device).items():
        results.append(_guarded({"op": name}, lambda: check_op(name, make, kind, chosen, dtype, lengths)))
    return results


# ------------------------------------------------------------------------------------------------ layouts


def kernel_paths(device) -> list[tuple[str, str]]:
    """(op, backend) for every CUDA kernel path whose library is installed (each attention library on its own); on
    CPU every op's reference, so the plumbing runs."""
    if device.type != "cuda":
        return [(name, backends.REFERENCE) for name in _op_cases(device)]
    paths = [("varlen_attention", b) for b in ("flash_attn", "torch_varlen") if backends.is_installed(b)]
    for name, backend in (("causal_conv1d_varlen", "causal_conv1d"), ("gated_delta_rule_varlen", "fla"),
                          ("kimi_delta_attention_varlen", "fla"), ("mamba2_chunk_scan_varlen", "mamba_ssm")):
        if backends.is_installed(backend):
            paths.append((name, backend))
    return paths


def check_layout(op, backend, layout, make, dtype):
    lengths, rows = LAYOUTS[layout]
    tensors, _, call = make(lengths, rows, dtype, layout)
    kernel, kernel_grads = _run(call, tensors, lengths, rows, backend)
    fp32, fp32_grads = _run(call, tensors, lengths, rows, backends.REFERENCE, dtype=torch.float32)
    errors = [_relative(kernel, fp32)] + [_relative(g, f) for g, f in zip(kernel_grads, fp32_grads)
                                          if g is not None and f is not None]
    finite = _finite(kernel, *kernel_grads)
    return {"op": op, "backend": backend, "layout": layout, "lengths": lengths, "rows": rows, "dtype": str(dtype),
            "finite": finite, "relative_error": max(errors), "ok": finite and max(errors) <= TOLERANCE[dtype]}


def check_layouts(device, dtype, smoke):
    cases = _op_cases(device)
    names = SMOKE_LAYOUTS if smoke else tuple(LAYOUTS)
    results = []
    for op, backend in kernel_paths(device):
        for layout in names:
            context = {"op": op, "backend": backend, "layout": layout}
            results.append(_guarded(context, lambda: check_layout(op, backend, layout, cases[op][0], dtype)))
    return results


# ------------------------------------------------------------------------------------------------ known bugs


def _short_attention_inputs(device, dtype):
    """flash-attn #1537's trigger: 1-token and empty documents, max_seqlen 1, more query than key heads."""
    lengths = [1, 0, 1, 1, 0]
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, 64, generator=gen).to(device, dtype) for heads in (8, 2, 2))
    return lengths, q, k, v


def _attention_bug(device, dtype, backend, causal, alone):
    lengths, q, k, v = _short_attention_inputs(device, dtype)
    cu = _cu(lengths, device)
    result = {"bug": "flash-attn #1537", "backend": backend, "causal": causal, "lengths": lengths}
    try:
        alone(q, k, v, cu)
        _synchronize(device)
        result["library_alone"] = "ran"
    except Exception as error:  # the reported failure: recorded, it is the finding
        result["library_alone"] = _describe(error)
    guarded = varlen_attention(q, k, v, cu, 1, causal=causal, backend=backend).float()
    reference = varlen_attention(q.float(), k.float(), v.float(), cu, 1, causal=causal, backend=backends.REFERENCE)
    result["guarded_relative_error"] = _relative(guarded, reference)
    result["ok"] = _finite(guarded) and result["guarded_relative_error"] <= TOLERANCE[dtype]
    return result


def check_known_bugs(device, dtype, budget):
    """The reported bugs whose failure on the library alone is host-side (or a wrong value): run here. The ones that
    may fault run in a child process (``PROBES``)."""
    if device.type != "cuda":
        return [{"skipped": "CUDA only"}]
    results = []
    if backends.is_installed("flash_attn"):
        def flash_alone(q, k, v, cu):
            flash = backends.load("flash_attn.flash_attn_interface")
            return flash.flash_attn_varlen_func(q, k, v, cu, cu, 1, 1, causal=False)

        results.append(_guarded({"bug": "flash-attn #1537", "backend": "flash_attn"},
                                lambda: _attention_bug(device, dtype, "flash_attn", False, flash_alone)))
    if backends.is_installed("torch_varlen"):
        def torch_alone(q, k, v, cu):
            backends.load("torch.nn.attention.varlen")
            return torch.ops.torch_attn._varlen_attn(q, k, v, cu, cu, 1, 1, True, 0.125, [-1, -1], True, None, None,
                                                     None)

        results.append(_guarded({"bug": "flash-attn #1537", "backend": "torch_varlen"},
                                lambda: _attention_bug(device, dtype, "torch_varlen", True, torch_alone)))
    for probe in ("conv_seq_idx_tail", "fla_slack_rows"):
        results.append(budget.run(45, lambda p=probe: run_probe(p, timeout=min(90, budget.left())), {"probe": probe}))
    return results


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
    cases = _op_cases(device)
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
            _run(call, tensors, lengths, rows, backend)
        before = _cache_sizes(_triton_kernels())
        for lengths, rows in stream:
            tensors, _, call = make(lengths, rows, dtype)
            _run(call, tensors, lengths, rows, backend)
        _synchronize(device)
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
    result = {"family": name, "backends": compilepack.patching.patch_state(patched).backends.describe(),
              "stock_path": stock_path(stock, device)}
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


# ------------------------------------------------------------------------------------------------ long rows

LAST_DOCUMENT = 71  # the long row's last document: a partial chunk, read at the row's largest offsets


def _last_document(function, inputs, token_dims, lengths, backward):
    """The output of ``function(inputs, lengths)`` over the last ``LAST_DOCUMENT`` tokens, and the gradients of the
    token inputs there (of the last document's squared output)."""
    inputs = [t.detach().requires_grad_(backward and t.is_floating_point()) for t in inputs]
    out = function(inputs, lengths)
    last = out.narrow(token_dims[0], out.shape[token_dims[0]] - LAST_DOCUMENT, LAST_DOCUMENT)
    grads = []
    if backward:
        tokens = [(t, d) for t, d in zip(inputs, token_dims) if d is not None]
        grads = torch.autograd.grad(last.float().square().sum(), [t for t, _ in tokens])
        grads = [g.narrow(d, g.shape[d] - LAST_DOCUMENT, LAST_DOCUMENT).float() for g, (_, d) in zip(grads, tokens)]
    return last.detach().float(), grads


def _compare_last(function, make, total, token_dims, backward):
    """A row of ``total`` tokens (``make(total)``) whose last document is ``LAST_DOCUMENT`` tokens, against that
    document alone through the same function: where an offset wraps, the row's end is what goes wrong."""
    tensors = make(total)
    alone_inputs = [t if d is None else t.narrow(d, t.shape[d] - LAST_DOCUMENT, LAST_DOCUMENT).clone()
                    for t, d in zip(tensors, token_dims)]
    packed, packed_grads = _last_document(function, tensors, token_dims, [total - LAST_DOCUMENT, LAST_DOCUMENT],
                                          backward)
    del tensors
    torch.cuda.empty_cache()
    alone, alone_grads = _last_document(function, alone_inputs, token_dims, [LAST_DOCUMENT], backward)
    errors = [_relative(packed, alone)] + [_relative(a, b) for a, b in zip(packed_grads, alone_grads)]
    return {"tokens": total, "backward": backward, "finite": _finite(packed, *packed_grads),
            "relative_error": max(errors), "ok": _finite(packed, *packed_grads) and max(errors) <= 5e-2}


class _Shape:
    """A stand-in with a tensor's shape and device, for the guards' size arithmetic without allocating."""

    def __init__(self, shape, device):
        self.shape, self.device = shape, torch.device(device)


def _largest_admitted(fits, step, high):
    """The largest multiple of ``step`` below ``high`` that ``fits`` admits (bisection; ``fits`` is monotone)."""
    low = step
    while high - low > step:
        middle = (low + high) // (2 * step) * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _probe_ssd(raw: bool):
    """mamba #1015/#1036 at Bamba-9B's scan widths (128 heads of 64, one group of state 128; chunks of 128 tokens,
    so that x and the chunk states reach the limit together): the guarded op at the longest row the guard gives the
    kernel and just past it (the reference, forward), or the library alone past it."""
    from compilepack.ops.mamba2 import mamba_ssm as glue

    device, dtype, heads, head_dim, state, chunk = torch.device("cuda"), torch.bfloat16, 128, 64, 128, 128

    def make(total):
        g = torch.Generator(device=device).manual_seed(0)
        return [torch.randn(1, total, heads, head_dim, device=device, dtype=dtype, generator=g),
                torch.randn(1, total, heads, device=device, dtype=dtype, generator=g) * 0.5,
                -torch.rand(heads, device=device, generator=g) - 0.5,
                torch.randn(1, total, 1, state, device=device, dtype=dtype, generator=g),
                torch.randn(1, total, 1, state, device=device, dtype=dtype, generator=g)]

    def fits(total):
        return glue.fits_int32_offsets(_Shape((1, total, heads, head_dim), device), _Shape((1, total, 1, state), device),
                                       chunk)

    limit = _largest_admitted(fits, chunk, 2**31 // (heads * head_dim) + 4 * chunk)
    dims = [1, 1, None, 1, 1]

    def guarded(inputs, lengths):
        x, dt, A, B, C = inputs
        return mamba2_chunk_scan_varlen(x, dt, A, B, C, chunk, dt_softplus=True, seq_idx=_seq_idx(lengths, device),
                                        backend="mamba_ssm")

    def library_alone(inputs, lengths):
        x, dt, A, B, C = inputs
        ssd = backends.load(glue.SSD_COMBINED)
        return ssd.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, seq_idx=_seq_idx(lengths, device),
                                             dt_softplus=True)

    result = {"widths": {"heads": heads, "head_dim": head_dim, "state": state, "chunk": chunk},
              "longest_row_on_the_kernel": limit}
    if raw:
        result["library_alone_past_the_limit"] = _compare_last(library_alone, make, limit + 2 * chunk, dims, True)
    else:
        result["guarded_at_the_limit"] = _compare_last(guarded, make, limit, dims, True)
        result["guarded_past_the_limit"] = _compare_last(guarded, make, limit + 2 * chunk, dims, False)
    return result


def _probe_conv(raw: bool):
    """causal-conv1d #114 (uint32 offsets) at Bamba-9B's conv width (8448 channels): the guarded op just below 2**32
    elements (the kernel) and past it (the reference), or the library alone past it."""
    from compilepack.ops.causal_conv1d import causal_conv1d_kernel as glue

    device, dtype, dim = torch.device("cuda"), torch.bfloat16, 8448
    limit = (glue.UINT32_ELEMENTS - 1) // dim // 64 * 64

    def make(total):
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(1, total, dim, device=device, dtype=dtype, generator=g).transpose(1, 2)
        return [x, torch.randn(dim, 4, device=device, dtype=dtype, generator=g) * 0.5,
                torch.randn(dim, device=device, dtype=dtype, generator=g)]

    dims = [2, None, None]

    def guarded(inputs, lengths):
        return causal_conv1d_varlen(*inputs, _seq_idx(lengths, device), "silu", backend="causal_conv1d")

    def library_alone(inputs, lengths):
        library = backends.load("causal_conv1d")
        return library.causal_conv1d_fn(*inputs, seq_idx=_seq_idx(lengths, device), activation="silu")

    result = {"dim": dim, "longest_row_on_the_kernel": limit}
    if raw:
        result["library_alone_past_the_limit"] = _compare_last(library_alone, make, limit + 128, dims, False)
    else:
        result["guarded_at_the_limit"] = _compare_last(guarded, make, limit, dims, True)
        result["guarded_past_the_limit"] = _compare_last(guarded, make, limit + 128, dims, False)
    return result


def _probe_fla():
    """fla 0.6 indexes in int64: a gated-delta-rule row past 2**31 elements of v (32 value heads of 128)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    total = 2**31 // (32 * 128) + 3 * 64 + 5

    def make(total):
        g = torch.Generator(device=device).manual_seed(0)
        return [torch.randn(1, total, 16, 128, device=device, dtype=dtype, generator=g),
                torch.randn(1, total, 16, 128, device=device, dtype=dtype, generator=g),
                torch.randn(1, total, 32, 128, device=device, dtype=dtype, generator=g),
                -torch.rand(1, total, 32, device=device, generator=g) * 0.5,
                torch.rand(1, total, 32, device=device, dtype=dtype, generator=g)]

    def guarded(inputs, lengths):
        cu = _cu(lengths, device)
        return gated_delta_rule_varlen(*inputs, cu, use_qk_l2norm=True, cu_seqlens_cpu=cu.cpu(), backend="fla")

    return {"past_int32": _compare_last(guarded, make, total, [1] * 5, False)}


def _probe_attention(backend):
    """flash-attn and torch's varlen index in int64: a row past 2**31 elements of q (32 heads of 128), documents of
    8192 tokens."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    total = 2**31 // (32 * 128) + 8192 + LAST_DOCUMENT

    def make(total):
        g = torch.Generator(device=device).manual_seed(0)
        return [torch.randn(total, heads, 128, device=device, dtype=dtype, generator=g) for heads in (32, 8, 8)]

    def guarded(inputs, lengths):
        if len(lengths) > 1:  # the long document cut in documents of 8192 tokens
            head = lengths[0]
            lengths = [8192] * (head // 8192) + ([head % 8192] if head % 8192 else []) + lengths[1:]
        return varlen_attention(*inputs, _cu(lengths, device), max(lengths), backend=backend)

    return {"backend": backend, "past_int32": _compare_last(guarded, make, total, [0, 0, 0], True)}


def _probe_conv_seq_idx_tail():
    """causal-conv1d #117: rows of 70 tokens, the library alone with the seq_idx tensor the collator makes (read up
    to 58 ints past its end), and the guarded op (padded storage); run with the caching allocator off, so the read
    is more likely to leave the allocation."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    lengths = [30, 1, 39]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, 70, 256, device=device, dtype=dtype, generator=g).transpose(1, 2)
    weight, bias = torch.randn(256, 4, device=device, dtype=dtype, generator=g), torch.randn(256, device=device,
                                                                                          dtype=dtype, generator=g)
    seq_idx = _seq_idx(lengths, device)
    library = backends.load("causal_conv1d")
    alone = library.causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
    guarded = causal_conv1d_varlen(x, weight, bias, seq_idx, "silu", backend="causal_conv1d")
    torch.cuda.synchronize()
    return {"library_alone": "ran", "guarded_vs_alone_max_diff": _max_err(guarded.float(), alone.float()),
            "installed": backends.installed_version("causal_conv1d")}


def _probe_fla_slack_rows():
    """fla #892: cu_seqlens[-1] < T. The library alone leaves the rows past cu_seqlens[-1] unwritten (output and
    gradients); compilepack's boundary contract (cu_seqlens[-1] == T, checked before any kernel) never hands it such
    a row. Recorded: whether those rows came back non-finite or nonzero."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    fla = backends.load("fla.ops.gated_delta_rule")
    g = torch.Generator(device=device).manual_seed(0)
    total, used = 200, 150
    q, k = (torch.randn(1, total, 4, 64, device=device, dtype=dtype, generator=g) for _ in range(2))
    v = torch.randn(1, total, 8, 64, device=device, dtype=dtype, generator=g)
    gate = -torch.rand(1, total, 8, device=device, generator=g) * 0.5
    beta = torch.rand(1, total, 8, device=device, dtype=dtype, generator=g)
    inputs = [t.requires_grad_() for t in (q, k, v, gate, beta)]
    cu = torch.tensor([0, 100, used], dtype=torch.int32, device=device)
    out, _ = fla.chunk_gated_delta_rule(*inputs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad(out.float().sum(), inputs)
    slack = [out[:, used:]] + [grad[:, used:] for grad in grads]
    torch.cuda.synchronize()
    return {"slack_rows_nonfinite": sum(int((~torch.isfinite(t.float())).sum()) for t in slack),
            "slack_rows_nonzero": sum(int((t.float() != 0).sum()) for t in slack)}


def _probe_long_rows_guarded():
    """Every long row the libraries should get right, one after the other in one process: the guarded SSD and conv
    at their limits and past them, fla and both attention libraries past 2**31 elements (int64 indexing)."""
    probes = {"ssd_int32": (lambda: _probe_ssd(raw=False), "mamba_ssm"),
              "conv_uint32": (lambda: _probe_conv(raw=False), "causal_conv1d"),
              "fla_int32": (_probe_fla, "fla"),
              "attention_int32_flash_attn": (lambda: _probe_attention("flash_attn"), "flash_attn"),
              "attention_int32_torch_varlen": (lambda: _probe_attention("torch_varlen"), "torch_varlen")}
    results = {}
    for name, (probe, backend) in probes.items():
        if not backends.is_installed(backend):
            results[name] = {"skipped": f"{backend} is not installed"}
            continue
        started = time.perf_counter()
        results[name] = {**_guarded({}, probe), "wall_s": round(time.perf_counter() - started, 1)}
        torch.cuda.empty_cache()
    return results


# name -> (the probe, the library it needs, its child process's extra environment)
PROBES = {
    "conv_seq_idx_tail": (_probe_conv_seq_idx_tail, "causal_conv1d", {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}),
    "fla_slack_rows": (_probe_fla_slack_rows, "fla", {}),
    "long_rows_guarded": (_probe_long_rows_guarded, backends.REFERENCE, {}),
    # the library alone past its limit may corrupt or fault its process: one process each
    "ssd_int32_library_alone": (lambda: _probe_ssd(raw=True), "mamba_ssm", {}),
    "conv_uint32_library_alone": (lambda: _probe_conv(raw=True), "causal_conv1d", {}),
}
LONG_ROW_PROBES = {"long_rows_guarded": 240, "ssd_int32_library_alone": 120, "conv_uint32_library_alone": 120}


def run_probe(name: str, timeout: float) -> dict:
    """Run one probe in a child process (a fault there cannot take this run down); its JSON, or what went wrong."""
    _, backend, environment = PROBES[name]
    if not backends.is_installed(backend):
        return {"probe": name, "skipped": f"{backend} is not installed"}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "probe.json"
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, str(SCRIPT), "--probe", name, "--out", str(out)],
                                  env={**os.environ, **environment}, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"probe": name, "error": f"timed out after {timeout:.0f} s"}
        result = json.loads(out.read_text()) if out.exists() else {}
        result.update(probe=name, wall_s=round(time.perf_counter() - started, 1))
        if done.returncode != 0:
            result["exit_code"] = done.returncode
            result["stderr_tail"] = done.stderr[-800:]
        return result


def check_long_rows(device, budget):
    if device.type != "cuda":
        return [{"skipped": "CUDA only"}]
    return [budget.run(60, lambda p=probe, t=limit: run_probe(p, timeout=min(t, budget.left() - 15)), {"probe": probe})
            for probe, limit in LONG_ROW_PROBES.items()]


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
        result[label] = _guarded({}, lambda sb=stock_batches: {**_throughput(stock, stock, sb, device),
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


def _describe(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(error)).strip()[-800:]


def _guarded(context, check):
    try:
        return check()
    except Exception as error:  # a check that fails is a finding: record it and go on
        return {**context, "error": _describe(error)}


def environment(device):
    info = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "compilepack": compilepack.__version__, "device": str(device),
        "installed": {name: backends.is_installed(name) for name in KERNEL_BACKENDS},
        "versions": {name: backends.installed_version(name) for name in backends.FLOORS},
        "auto_backends": _guarded({}, lambda: backends.resolve("auto").describe()),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return info


def _probe_main(name: str, out: str) -> int:
    """Child process of :func:`run_probe`: run the probe, write its JSON (its error if it raised)."""
    function = PROBES[name][0]
    result = _guarded({}, function)
    Path(out).write_text(json.dumps(result, indent=2))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--families", default=",".join(HEADLINE), help="comma list, or 'all'")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: exercise the plumbing in seconds")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (smoke: eager)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds after which no section starts (one started may run on: keep a margin)")
    parser.add_argument("--probe", choices=sorted(PROBES), help=argparse.SUPPRESS)  # a child process's one probe
    args = parser.parse_args(argv)
    if args.probe:
        return _probe_main(args.probe, args.out)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = [f.name for f in compilepack.families()] if args.families == "all" else args.families.split(",")
    started = time.perf_counter()
    budget = Budget(args.budget_s)
    report = {"environment": environment(device)}
    report["ops"] = check_ops(device, dtype, [5, 1, 70] if args.smoke else [300, 1, 64, 1024, 17, 700])
    report["layouts"] = budget.run(30, lambda: check_layouts(device, dtype, args.smoke), {})
    report["known_bugs"] = budget.run(30, lambda: check_known_bugs(device, dtype, budget), {})
    report["recompiles"] = budget.run(30, lambda: check_recompiles(device, dtype, args.smoke), {})
    backend = "eager" if args.smoke else args.compile_backend
    report["families"] = [budget.run(60, lambda n=n: check_family(n, device, dtype, args.smoke, backend),
                                     {"family": n}) for n in names]
    report["long_rows"] = check_long_rows(device, budget)
    steps, tokens = (2, 512) if args.smoke else (8, 16384)
    report["speed"] = [budget.run(45, lambda n=n: measure_speed(n, device, dtype, steps, tokens, backend, args.smoke),
                                  {"family": n}) for n in names]
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
