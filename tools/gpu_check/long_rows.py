"""Section 6 of the GPU check: rows near the int32 limits the bugs name, each probe in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from compilepack.ops import backends
from compilepack.ops import (
    causal_conv1d_varlen,
    gated_delta_rule_varlen,
    mamba2_chunk_scan_varlen,
    varlen_attention,
)
from .common import SCRIPT, cu_of, finite, guarded, max_err, relative_err, seq_idx_of

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
    errors = [relative_err(packed, alone)] + [relative_err(a, b) for a, b in zip(packed_grads, alone_grads)]
    return {"tokens": total, "backward": backward, "finite": finite(packed, *packed_grads),
            "relative_error": max(errors), "ok": finite(packed, *packed_grads) and max(errors) <= 5e-2}


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
        return mamba2_chunk_scan_varlen(x, dt, A, B, C, chunk, dt_softplus=True, seq_idx=seq_idx_of(lengths, device),
                                        backend="mamba_ssm")

    def library_alone(inputs, lengths):
        x, dt, A, B, C = inputs
        ssd = backends.load(glue.SSD_COMBINED)
        return ssd.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, seq_idx=seq_idx_of(lengths, device),
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
        return causal_conv1d_varlen(*inputs, seq_idx_of(lengths, device), "silu", backend="causal_conv1d")

    def library_alone(inputs, lengths):
        library = backends.load("causal_conv1d")
        return library.causal_conv1d_fn(*inputs, seq_idx=seq_idx_of(lengths, device), activation="silu")

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
        cu = cu_of(lengths, device)
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
        return varlen_attention(*inputs, cu_of(lengths, device), max(lengths), backend=backend)

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
    seq_idx = seq_idx_of(lengths, device)
    library = backends.load("causal_conv1d")
    alone = library.causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
    guarded = causal_conv1d_varlen(x, weight, bias, seq_idx, "silu", backend="causal_conv1d")
    torch.cuda.synchronize()
    return {"library_alone": "ran", "guarded_vs_alone_max_diff": max_err(guarded.float(), alone.float()),
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
        results[name] = {**guarded({}, probe), "wall_s": round(time.perf_counter() - started, 1)}
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
