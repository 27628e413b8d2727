"""Sections 1-3 of the GPU check: every op against its reference, the bugs' layouts, the bugs' triggers."""

from __future__ import annotations


import torch

from compilepack.ops import backends
from compilepack.ops import (
    varlen_attention,
)
from .common import (
    LAYOUTS,
    SMOKE_LAYOUTS,
    TOLERANCE,
    cu_of,
    describe,
    finite,
    guarded,
    max_err,
    op_cases,
    relative_err,
    run_op,
    synchronize,
    usable_backends,
)
from .long_rows import run_probe

# ------------------------------------------------------------------------------------------------ ops


def check_op(name, make, kind, chosen, dtype, lengths):
    backend = getattr(chosen, kind)
    result = {"op": name, "backend": backend, "dtype": str(dtype), "lengths": lengths}
    tensors, token_dims, call = make(lengths, 1, dtype)
    kernel, kernel_grads = run_op(call, tensors, lengths, 1, backend)
    same_dtype, same_dtype_grads = run_op(call, tensors, lengths, 1, backends.REFERENCE)
    fp32, fp32_grads = run_op(call, tensors, lengths, 1, backends.REFERENCE, dtype=torch.float32)
    kernel_err, ref_err = max_err(kernel, fp32), max_err(same_dtype, fp32)
    result["out"] = {"kernel_vs_fp32": kernel_err, "reference_same_dtype_vs_fp32": ref_err,
                     "relative": relative_err(kernel, fp32)}
    # the references compute in fp32 whatever their inputs, so their "same dtype" error is only the output's
    # rounding: a kernel that computes in bf16 passes by the dtype's tolerance instead
    tolerance = TOLERANCE[dtype]
    ok = kernel_err <= 2 * ref_err + 1e-5 or result["out"]["relative"] <= tolerance
    result["grads"] = []
    for g, r, f in zip(kernel_grads, same_dtype_grads, fp32_grads):
        if g is None or f is None:
            continue
        entry = {"kernel_vs_fp32": max_err(g, f), "reference_same_dtype_vs_fp32": max_err(r, f),
                 "relative": relative_err(g, f)}
        ok &= entry["kernel_vs_fp32"] <= 2 * entry["reference_same_dtype_vs_fp32"] + 1e-5 or (
            entry["relative"] <= tolerance)
        result["grads"].append(entry)
    result["packed_vs_alone_same_kernel"] = _packed_vs_alone(call, tensors, token_dims, lengths, backend, kernel)
    result["ok"] = bool(ok and finite(kernel, *kernel_grads))
    return result


def _packed_vs_alone(call, tensors, token_dims, lengths, backend, packed):
    """The same kernel on each document's slice of the same inputs, compared with the packed output."""
    error, start = 0.0, 0
    out_dim = token_dims[0]
    for n in lengths:
        if n == 0:
            continue
        pieces = [t if d is None else t.narrow(d, start, n) for t, d in zip(tensors, token_dims)]
        alone, _ = run_op(call, pieces, [n], 1, backend)
        error = max(error, max_err(packed.narrow(out_dim, start, n), alone))
        start += n
    return error


def check_ops(device, dtype, lengths):
    chosen, _ = usable_backends()  # a refused library is recorded in the environment; its kind runs the next one
    results = []
    for name, (make, kind) in op_cases(device).items():
        results.append(guarded({"op": name}, lambda: check_op(name, make, kind, chosen, dtype, lengths)))
    return results


# ------------------------------------------------------------------------------------------------ layouts


def kernel_paths(device) -> list[tuple[str, str]]:
    """(op, backend) for every CUDA kernel path whose library is installed (each attention library on its own); on
    CPU every op's reference, so the plumbing runs."""
    if device.type != "cuda":
        return [(name, backends.REFERENCE) for name in op_cases(device)]
    paths = [("varlen_attention", b) for b in ("flash_attn", "torch_varlen") if backends.is_installed(b)]
    for name, backend in (("causal_conv1d_varlen", "causal_conv1d"), ("gated_delta_rule_varlen", "fla"),
                          ("kimi_delta_attention_varlen", "fla"), ("mamba2_chunk_scan_varlen", "mamba_ssm")):
        if backends.is_installed(backend):
            paths.append((name, backend))
    return paths


def check_layout(op, backend, layout, make, dtype):
    """The kernel on one layout against the fp32 reference, each output and gradient apart, beside the reference's
    own error in the same dtype: a miss is the kernel's only where it is also over twice that (flash-attention's
    rule). The first GPU run (2026-12-04) saw KDA's padding-document layout at 0.33 with no way to tell which."""
    lengths, rows = LAYOUTS[layout]
    tensors, _, call = make(lengths, rows, dtype, layout)
    kernel = _outputs(*run_op(call, tensors, lengths, rows, backend))
    same_dtype = _outputs(*run_op(call, tensors, lengths, rows, backends.REFERENCE))
    fp32 = _outputs(*run_op(call, tensors, lengths, rows, backends.REFERENCE, dtype=torch.float32))
    names = ["out", *(f"grad{i}" for i in range(len(kernel) - 1))]
    per_tensor = {
        name: {"kernel": relative_err(k, f), "reference_same_dtype": relative_err(r, f)}
        for name, k, r, f in zip(names, kernel, same_dtype, fp32) if k is not None and f is not None
    }
    worst = max(e["kernel"] for e in per_tensor.values())
    within = all(e["kernel"] <= max(TOLERANCE[dtype], 2 * e["reference_same_dtype"]) for e in per_tensor.values())
    all_finite = finite(*(t for t in kernel if t is not None))
    return {"op": op, "backend": backend, "layout": layout, "lengths": lengths, "rows": rows, "dtype": str(dtype),
            "finite": all_finite, "relative_error": worst, "per_tensor": per_tensor, "ok": all_finite and within}


def _outputs(out, grads):
    return [out, *grads]


def check_layouts(device, dtype, smoke):
    cases = op_cases(device)
    names = SMOKE_LAYOUTS if smoke else tuple(LAYOUTS)
    results = []
    for op, backend in kernel_paths(device):
        for layout in names:
            context = {"op": op, "backend": backend, "layout": layout}
            results.append(guarded(context, lambda: check_layout(op, backend, layout, cases[op][0], dtype)))
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
    cu = cu_of(lengths, device)
    result = {"bug": "flash-attn #1537", "backend": backend, "causal": causal, "lengths": lengths}
    try:
        alone(q, k, v, cu)
        synchronize(device)
        result["library_alone"] = "ran"
    except Exception as error:  # the reported failure: recorded, it is the finding
        result["library_alone"] = describe(error)
    guarded = varlen_attention(q, k, v, cu, 1, causal=causal, backend=backend).float()
    reference = varlen_attention(q.float(), k.float(), v.float(), cu, 1, causal=causal, backend=backends.REFERENCE)
    result["guarded_relative_error"] = relative_err(guarded, reference)
    result["ok"] = finite(guarded) and result["guarded_relative_error"] <= TOLERANCE[dtype]
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

        results.append(guarded({"bug": "flash-attn #1537", "backend": "flash_attn"},
                                lambda: _attention_bug(device, dtype, "flash_attn", False, flash_alone)))
    if backends.is_installed("torch_varlen"):
        def torch_alone(q, k, v, cu):
            backends.load("torch.nn.attention.varlen")
            return torch.ops.torch_attn._varlen_attn(q, k, v, cu, cu, 1, 1, True, 0.125, [-1, -1], True, None, None,
                                                     None)

        results.append(guarded({"bug": "flash-attn #1537", "backend": "torch_varlen"},
                                lambda: _attention_bug(device, dtype, "torch_varlen", True, torch_alone)))
    for probe in ("conv_seq_idx_tail", "fla_slack_rows"):
        results.append(budget.run(45, lambda p=probe: run_probe(p, timeout=min(90, budget.left())), {"probe": probe}))
    return results
