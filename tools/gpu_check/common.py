"""What every section of the GPU check shares: settings, the time budget, inputs, error capture."""

from __future__ import annotations

import platform
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import DataCollatorWithFlattening

import compilepack
from compilepack.ops import backends
from compilepack.ops import (
    causal_conv1d_varlen,
    gated_delta_rule_varlen,
    kimi_delta_attention_varlen,
    mamba2_chunk_scan_varlen,
    varlen_attention,
)

HEADLINE = ["llama", "qwen3_next", "qwen3_5", "bamba"]
COLLATE = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"  # the long-row probes run it in child processes
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
        return guarded(context or {}, check)


# ------------------------------------------------------------------------------------------------ inputs


def cu_of(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def seq_idx_of(lengths, device, rows=1):
    """Document index per token, ``[rows, T / rows]``, numbered as the patch numbers them (a zero-length document
    takes no tokens and leaves a gap in the numbering)."""
    counts = torch.tensor(lengths, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device, dtype=torch.int32), counts).view(rows, -1)


def as_padding(tokens, lengths, layout):
    """The layout's padding-only document made of identical tokens: its first token's values repeated
    (``tokens`` token-major, ``[rows * T or T, ...]`` contiguous views)."""
    index = PADDING_DOCUMENT.get(layout)
    if index is not None:
        start, end = sum(lengths[:index]), sum(lengths[: index + 1])
        for t in tokens:
            t[start:end] = t[start]


def op_cases(device):
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
        as_padding(tokens, lengths, layout)

        def call(x, ls, rows, b):
            return varlen_attention(*x, cu_of(ls, device), max(max(ls), 1), backend=b)

        return on(tokens, [dtype] * 3), [0, 0, 0], call

    def conv(lengths, rows, dtype, layout=None):
        t = sum(lengths)
        x = randn(t, 256)
        as_padding([x], lengths, layout)
        x = x.view(rows, t // rows, 256).transpose(1, 2)  # channel-last, as transformers passes it
        tensors = on([x, randn(256, 4, scale=0.5), randn(256)], [dtype] * 3)

        def call(x, ls, rows, b):
            return causal_conv1d_varlen(*x, seq_idx_of(ls, device, rows), "silu", backend=b)

        return tensors, [2, None, None], call

    def delta_rule(per_channel):
        def make(lengths, rows, dtype, layout=None):
            t = sum(lengths)
            decay = F.logsigmoid(randn(t, 8, 64) + 3) if per_channel else -torch.rand(t, 8, generator=gen) * 0.5
            tokens = [randn(t, 4, 64), randn(t, 4, 64), randn(t, 8, 64), decay, torch.rand(t, 8, generator=gen)]
            as_padding(tokens, lengths, layout)
            shaped = [x.view(rows, t // rows, *x.shape[1:]) for x in tokens]
            function = kimi_delta_attention_varlen if per_channel else gated_delta_rule_varlen

            def call(x, ls, rows, b):
                cu = cu_of(ls, device)
                return function(*x, cu, use_qk_l2norm=True, cu_seqlens_cpu=cu.cpu(), backend=b)

            return on(shaped, [dtype, dtype, dtype, torch.float32, dtype]), [1] * 5, call

        return make

    def ssd(lengths, rows, dtype, layout=None):
        t = sum(lengths)
        tokens = [randn(t, 8, 64), randn(t, 8, scale=0.5), randn(t, 1, 64), randn(t, 1, 64)]
        as_padding(tokens, lengths, layout)
        x, dt, B, C = (v.view(rows, t // rows, *v.shape[1:]) for v in tokens)
        A = -torch.rand(8, generator=gen) - 0.5
        tensors = on([x, dt, A, B, C, torch.ones(8), torch.zeros(8)],
                     [dtype, dtype, torch.float32, dtype, dtype, torch.float32, torch.float32])

        def call(x, ls, rows, b):
            xs, dt, A, B, C, D, dt_bias = x
            return mamba2_chunk_scan_varlen(xs, dt, A, B, C, 64, D=D, dt_bias=dt_bias, dt_softplus=True,
                                            seq_idx=seq_idx_of(ls, device, rows), backend=b)

        return tensors, [1, 1, None, 1, 1, None, None], call

    return {"varlen_attention": (attention, "attention"), "causal_conv1d_varlen": (conv, "conv"),
            "gated_delta_rule_varlen": (delta_rule(False), "gated_delta"),
            "kimi_delta_attention_varlen": (delta_rule(True), "delta_rule"),
            "mamba2_chunk_scan_varlen": (ssd, "ssd")}


def run_op(call, tensors, lengths, rows, backend, dtype=None):
    """Output and input gradients (fp32 copies) of one call; ``dtype`` casts the float inputs first."""
    inputs = [(t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().requires_grad_()
              for t in tensors]
    out = call(inputs, lengths, rows, backend)
    grad = torch.ones_like(out) / out.numel() ** 0.5
    grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    return out.float(), [None if g is None else g.float() for g in grads]


def max_err(a, b):
    return (a - b).abs().max().item()


def relative_err(a, b):
    """Largest |a - b| relative to the largest |b| (at least 1e-6)."""
    return max_err(a, b) / max(b.abs().max().item(), 1e-6)


def finite(*tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


# ------------------------------------------------------------------------------------------------ plumbing


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def describe(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(error)).strip()[-800:]


def guarded(context, check):
    try:
        return check()
    except Exception as error:  # a check that fails is a finding: record it and go on
        return {**context, "error": describe(error)}


def usable_backends() -> tuple[backends.Backends, dict[str, str]]:
    """The backends a GPU run patches with: per op kind the first installed candidate that compilepack admits here
    (``auto`` refuses a library below its floor or wrong on this GPU instead of passing it over), and each refusal
    met on the way ("kind:backend" -> its message), so one refused library still leaves the others checked."""
    chosen, refused = {}, {}
    for kind, candidates in backends.CANDIDATES.items():
        for name in candidates:
            if not backends.is_installed(name):
                continue
            try:
                backends.check_floor(name, kind)
                backends.check_platform(name, kind)
            except backends.KernelVersionError as refusal:
                refused[f"{kind}:{name}"] = str(refusal)
                continue
            chosen[kind] = name
            break
    return backends.Backends(**chosen), refused


def environment(device):
    info = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "compilepack": compilepack.__version__, "device": str(device),
        "installed": {name: backends.is_installed(name) for name in KERNEL_BACKENDS},
        "versions": {name: backends.installed_version(name) for name in backends.FLOORS},
        "auto_backends": guarded({}, lambda: backends.resolve("auto").describe()),
        "checked_backends": usable_backends()[0].describe(),
        "refused_backends": usable_backends()[1],
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
