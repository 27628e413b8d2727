"""Op sections of the GPU check: every op against its reference, the reported bugs' layouts and triggers, and the
Triton kernels' recompiles over varied batches. Each runs the backends compilepack admits on this machine only
(``Context.admitted``) and records the refusals beside them."""

from __future__ import annotations

import inspect
import random
import sys

import torch

from compilepack.ops import backends, varlen_attention

from .common import (LAYOUTS, SIMULATED_LAYOUTS, TOLERANCE, Context, against_reference, cu_of, describe, finite,
                     guarded, max_err, op_cases, relative_err, run_op, synchronize)

OP_LENGTHS = [300, 1, 64, 1024, 17, 700]
SIMULATED_OP_LENGTHS = [5, 1, 70]


def check_op(name, make, backend, dtype, lengths):
    """One op on ``backend`` against the references (``against_reference``), and packed == each document alone
    through the same kernel."""
    tensors, token_dims, call = make(lengths, 1, dtype)
    result = {"op": name, "lengths": lengths, **against_reference(
        lambda x, b: call(x, lengths, 1, b), tensors, backend, dtype)}
    packed = call(tensors, lengths, 1, backend).detach().float()
    error, start = 0.0, 0
    for n in (n for n in lengths if n):
        pieces = [t if d is None else t.narrow(d, start, n) for t, d in zip(tensors, token_dims)]
        alone = call(pieces, [n], 1, backend).detach().float()
        error = max(error, max_err(packed.narrow(token_dims[0], start, n), alone))
        start += n
    result["packed_vs_alone_same_kernel"] = error
    result["out"], *result["grads"] = result["per_tensor"].values()  # the names the first run's record used
    return result


def check_ops(ctx: Context):
    """Every op on its best admitted backend (the reference where none is: its first run on this device)."""
    lengths = SIMULATED_OP_LENGTHS if ctx.simulate else OP_LENGTHS
    chosen = ctx.chosen()
    return [guarded({"op": name, "backend": chosen[name]},
                    lambda n=name, m=make: check_op(n, m, chosen[n], ctx.dtype, lengths))
            for name, make in op_cases(ctx.device).items()]


def kernel_paths(ctx: Context) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(op, backend) for every admitted kernel (simulated: the references), and the refusals passed over."""
    paths, refused = [], {}
    for op in op_cases(ctx.device):
        refused.update(ctx.refusals(op))
        if ctx.admitted[op] or not ctx.cuda:
            paths += [(op, backend) for backend in ctx.paths(op)]
    return paths, refused


def check_layout(op, backend, layout, make, dtype, simulate=False):
    """The kernel on one of the reported bugs' layouts, per tensor (the first GPU run saw KDA's padding-document
    layout at 0.33 with no way to tell which tensor)."""
    lengths, rows = (SIMULATED_LAYOUTS if simulate else LAYOUTS)[layout]
    tensors, _, call = make(lengths, rows, dtype, layout)
    return {"op": op, "layout": layout, "lengths": lengths, "rows": rows,
            **against_reference(lambda x, b: call(x, lengths, rows, b), tensors, backend, dtype)}


def check_layouts(ctx: Context):
    cases = op_cases(ctx.device)
    paths, refused = kernel_paths(ctx)
    results = [{"refused": key, "message": message} for key, message in refused.items()]
    for op, backend in paths:
        for layout in list(SIMULATED_LAYOUTS)[:2] if ctx.simulate else LAYOUTS:
            results.append(guarded({"op": op, "backend": backend, "layout": layout}, lambda o=op, b=backend, la=layout:
                                   check_layout(o, b, la, cases[o], ctx.dtype, ctx.simulate)))
    return results


# ------------------------------------------------------------------------------------------------ known bugs


def _attention_bug(device, dtype, backend, alone):
    """flash-attn #1537's trigger: 1-token and empty documents, max_seqlen 1, more query than key heads, on the
    library alone and on compilepack's guarded path."""
    lengths = [1, 0, 1, 1, 0]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), heads, 64, generator=gen).to(device, dtype) for heads in (8, 2, 2))
    cu = cu_of(lengths, device)
    result = {"bug": "flash-attn #1537", "backend": backend, "lengths": lengths}
    try:
        alone(q, k, v, cu)
        synchronize(device)
        result["library_alone"] = "ran"
    except Exception as error:  # noqa: BLE001 - the reported failure: recorded, it is the finding
        result["library_alone"] = describe(error)
    out = varlen_attention(q, k, v, cu, 1, backend=backend).float()
    reference = varlen_attention(q.float(), k.float(), v.float(), cu, 1, backend=backends.REFERENCE)
    result["guarded_relative_error"] = relative_err(out, reference)
    result["ok"] = finite(out) and result["guarded_relative_error"] <= TOLERANCE[dtype]
    return result


def _library_call(backend, cuda):
    """The admitted attention library called directly, as a user would (simulated: the reference)."""
    if backend == "flash_attn" and cuda:
        flash = backends.load("flash_attn.flash_attn_interface")
        return lambda q, k, v, cu: flash.flash_attn_varlen_func(q, k, v, cu, cu, 1, 1, causal=True)
    if backend == "torch_varlen" and cuda:
        varlen = backends.load("torch.nn.attention.varlen").varlen_attn
        known = inspect.signature(varlen).parameters  # its keywords change from release to release
        causal = {"is_causal": True} if "is_causal" in known else {"window_size": (-1, 0)}
        gqa = {"enable_gqa": True} if "enable_gqa" in known else {}
        return lambda q, k, v, cu: varlen(q, k, v, cu, cu, 1, 1, **causal, **gqa)
    return lambda q, k, v, cu: varlen_attention(q, k, v, cu, 1, backend=backends.REFERENCE)


def check_known_bugs(ctx: Context):
    """The reported bugs whose failure on the library alone is host-side or a wrong value, run in this process, on
    each admitted attention library (conv #117 and fla #892 need libraries the lent image lacks or refuses)."""
    results = [{"refused": key, "message": message} for key, message in ctx.refusals("varlen_attention").items()]
    for backend in ctx.admitted["varlen_attention"] or ([] if ctx.cuda else [backends.REFERENCE]):
        results.append(guarded({"bug": "flash-attn #1537", "backend": backend},
                               lambda b=backend: _attention_bug(ctx.device, ctx.dtype, b, _library_call(b, ctx.cuda))))
    return results or [{"skipped": "no admitted attention library"}]


# ------------------------------------------------------------------------------------------------ recompiles


def _cache_sizes(prefixes=("fla.", "mamba_ssm.")) -> dict[str, tuple[int, int]]:
    """Per Triton kernel the kernel libraries define: (its compiled variants, the autotuned keys around it)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    sizes = {}
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
                caches = getattr(fn, "device_caches", {})
                variants = sum(len(entry[0]) for entry in caches.values()) if isinstance(caches, dict) else 0
                sizes[f"{fn.__module__}.{fn.__name__}"] = (variants, sum(len(t.cache) for t in tuners))
    return sizes


def varied_batches(seed, count, longest=700):
    """(lengths, rows): 1 or 2 rows of up to 6 documents each, an empty document after the first."""
    rng = random.Random(seed)
    batches = []
    for _ in range(count):
        per_row = []
        for _ in range(rng.choice([1, 2])):
            row = [rng.randint(1, longest) for _ in range(rng.randint(1, 6))]
            row.insert(rng.randint(1, len(row)), 0)
            per_row.append(row)
        length = max(sum(row) for row in per_row)
        for row in per_row:
            row[0] += length - sum(row)  # rows of one length
        batches.append(([n for row in per_row for n in row], len(per_row)))
    return batches


def check_recompiles(ctx: Context):
    """After one warm-up batch, batches of new lengths, document counts and rows through each admitted Triton op,
    forward and backward: the JIT variants and autotuning runs they add, per kernel (dynamo's own recompiles are
    the families section's ``compiles_over_batches``)."""
    cases = op_cases(ctx.device)
    paths, refused = kernel_paths(ctx)
    paths = [(op, b) for op, b in paths if b in ("fla", "mamba_ssm") or not ctx.cuda]
    results = {"refused": refused} if refused else {}
    for op, backend in paths:
        def stream(seed, count, make=cases[op], b=backend):
            for lengths, rows in varied_batches(seed, count, 30 if ctx.simulate else 700):
                tensors, _, call = make(lengths, rows, ctx.dtype)
                run_op(lambda x, b, c=call, ls=lengths, r=rows: c(x, ls, r, b), tensors, b)
            synchronize(ctx.device)

        def count(s=stream):
            s(0, 1)
            before = _cache_sizes()
            s(1, 2 if ctx.simulate else 6)
            after = _cache_sizes()
            grown = {k: (after[k][0] - before.get(k, (0, 0))[0], after[k][1] - before.get(k, (0, 0))[1])
                     for k in after if after[k] != before.get(k, (0, 0))}
            return {"new_jit_variants": {k: v for k, (v, _) in grown.items() if v},
                    "new_autotune_runs": {k: t for k, (_, t) in grown.items() if t}, "ok": not grown}

        results[f"{op}/{backend}"] = guarded({}, count)
    return results or {"skipped": "no admitted Triton kernel library"}
