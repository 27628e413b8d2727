"""What the GPU check's sections share: the run's context (device, budget, backends admitted here), inputs, errors."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import itertools
import platform
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F
import transformers

import compilepack
from compilepack.ops import (backends, causal_conv1d_varlen, gated_delta_rule_varlen, kimi_delta_attention_varlen,
                             mamba2_chunk_scan_varlen, varlen_attention)
from compilepack.batch.derived import seq_idx_from_cu_seqlens
from compilepack.patching import family_named

HEADLINE = ["llama", "qwen3_5", "qwen3_next", "bamba"]
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
# simulated (CPU, references): the same layouts at a few tokens; the layouts section runs the first two
SIMULATED_LAYOUTS = {"zero-length": ([7, 0, 9, 0, 5, 0, 0], 1), "packed-collator": ([1, 0, 5, 1, 3, 4, 1, 5, 0, 0], 2),
                     "chunk-size-pm-1": ([31, 33, 32, 65], 1), "padding-document": ([12, 1, 39], 1)}
PADDING_DOCUMENT = {"padding-document": 2, "packed-collator": 7}  # the padding-only document of a layout


class Budget:
    """The run's time budget: a section (or a family) starts only with its planned seconds left."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def skipped(self, planned_s: float) -> dict:
        return {"skipped": f"time budget: {self.left():.0f} s left, planned {planned_s:g} s"}

    def run(self, planned_s: float, check, context=None):
        context = context or {}
        return {**context, **self.skipped(planned_s)} if self.left() < planned_s else guarded(context, check)


@dataclasses.dataclass
class Context:
    """One run's settings and what this machine admits (``admitted``: op -> its kernel backends compilepack accepts
    here, best first; ``refused``: "op:backend" -> compilepack's message)."""

    device: torch.device
    dtype: torch.dtype
    simulate: bool
    budget: Budget
    compile_backend: str
    families: list[str]
    admitted: dict[str, list[str]]
    refused: dict[str, str]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def chosen(self) -> dict[str, str]:
        """Per op the best admitted backend (the reference where none is): what the families patch with."""
        return {op: (names or [backends.REFERENCE])[0] for op, names in self.admitted.items()}

    def paths(self, op: str) -> list[str]:
        """The backends a kernel section runs for ``op``: every admitted kernel, or (simulated, or none admitted)
        the reference, so the section's plumbing still runs; on CPU a kernel name runs its reference anyway."""
        return self.admitted[op] or [backends.REFERENCE]

    def refusals(self, op: str) -> dict[str, str]:
        return {key: message for key, message in self.refused.items() if key.startswith(f"{op}:")}


def admitted_backends() -> tuple[dict[str, list[str]], dict[str, str]]:
    """Per op with a kernel the installed backends compilepack admits on this machine, and each refusal with its
    message. Asked through the public ``resolve`` one op at a time, so that a refusal for one op never hides
    another's backends (fla #640 refuses the gated delta rule, not KDA)."""
    admitted, refused = {}, {}
    for op in (op for op in backends.OPS if len(backends.candidates(op)) > 1):
        admitted[op] = []
        for name in backends.candidates(op)[:-1]:  # the kernels, the reference last
            if not backends.is_installed(name):
                continue
            try:
                backends.resolve({op: name}, ops=(op,))
            except (compilepack.KernelVersionError, ValueError) as refusal:
                refused[f"{op}:{name}"] = str(refusal)
                continue
            admitted[op].append(name)
    return admitted, refused


def hide_from_stock(refused, families) -> dict[str, str]:
    """Import the families' transformers modules while each library compilepack refuses for some op it serves
    cannot be imported: stock binds its kernels at import (why: docs/benchmarks.md, "Refusals"), and fla refused
    for the gated delta rule would be bound by stock Qwen3.5 even where KDA admits it. The library is importable
    again after (compilepack's own answers unchanged)."""
    hidden = {}
    for key in refused:
        op, name = key.split(":")
        if name != "torch_varlen":  # torch stays
            hidden[name] = f"refused for {op!r}: hidden from stock transformers' imports"
    before = {name: sys.modules.pop(name, None) for name in hidden}
    sys.modules.update(dict.fromkeys(hidden))  # None: `import fla` raises ImportError
    try:
        for family in families:
            with torch.device("meta"):
                transformers.AutoModelForCausalLM.from_config(family_named(family).bench_config())
    finally:
        for name, module in before.items():
            sys.modules.pop(name)
            if module is not None:
                sys.modules[name] = module
    return hidden


def auto_outcome(model=None) -> dict:
    """What ``resolve("auto")`` (or ``compilepack.patch(model)``) does here: the backends, the warnings it gave, or
    its refusal."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            chosen = backends.resolve("auto") if model is None else (
                compilepack.patching.patch_state(compilepack.patch(model)).backends)
            result = {"backends": chosen.describe()}
        except (compilepack.KernelVersionError, ValueError) as refusal:
            result = {"refused": str(refusal)}
    notes = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return {**result, "warnings": notes} if notes else result


def cu_of(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def seq_idx_of(lengths, device, rows=1):
    """Document index per token, ``[rows, T / rows]`` (a zero-length document leaves a gap in the numbering)."""
    return seq_idx_from_cu_seqlens(cu_of(lengths, device), sum(lengths)).view(rows, -1)


def op_cases(device, head_dim=64):
    """op name -> make. ``make(lengths, rows, dtype, layout)`` returns the op's differentiable inputs, the
    dimension of each that runs over tokens (None: a parameter) and ``call(inputs, lengths, rows, backend)``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    randn = functools.partial(torch.randn, generator=gen)

    def tokens_of(lengths, rows, layout, *tokens):
        """Token-major inputs shaped ``[rows, T / rows, ...]``, the layout's padding document one repeated token."""
        if layout in PADDING_DOCUMENT:
            start, end = sum(lengths[: PADDING_DOCUMENT[layout]]), sum(lengths[: PADDING_DOCUMENT[layout] + 1])
            for t in tokens:
                t[start:end] = t[start]
        return [t.view(rows, t.shape[0] // rows, *t.shape[1:]) for t in tokens]

    def on(tensors, dtypes):
        return [t.to(device=device, dtype=d) for t, d in zip(tensors, dtypes)]

    def attention(lengths, rows, dtype, layout=None):
        tokens = [t[0] for t in tokens_of(lengths, 1, layout, *(randn(sum(lengths), h, 64) for h in (8, 2, 2)))]

        def call(x, ls, rows, b):
            return varlen_attention(*x, cu_of(ls, device), max(max(ls), 1), backend=b)

        return on(tokens, [dtype] * 3), [0, 0, 0], call

    def conv(lengths, rows, dtype, layout=None):
        (x,) = tokens_of(lengths, rows, layout, randn(sum(lengths), 256))

        def call(x, ls, rows, b):
            return causal_conv1d_varlen(*x, seq_idx_of(ls, device, rows), "silu", backend=b)

        # channel-last, as transformers passes it
        return on([x.transpose(1, 2), randn(256, 4) * 0.5, randn(256)], [dtype] * 3), [2, None, None], call

    def delta_rule(function, per_channel):
        def make(lengths, rows, dtype, layout=None):
            t, d = sum(lengths), head_dim
            decay = F.logsigmoid(randn(t, 8, d) + 3) if per_channel else -torch.rand(t, 8, generator=gen) * 0.5
            tokens = tokens_of(lengths, rows, layout, randn(t, 4, d), randn(t, 4, d), randn(t, 8, d), decay,
                               torch.rand(t, 8, generator=gen))

            def call(x, ls, rows, b):
                cu = cu_of(ls, device)
                return function(*x, cu, use_qk_l2norm=True, cu_seqlens_cpu=cu.cpu(), backend=b)

            return on(tokens, [dtype, dtype, dtype, torch.float32, dtype]), [1] * 5, call

        return make

    def ssd(lengths, rows, dtype, layout=None):
        t = sum(lengths)
        x, dt, B, C = tokens_of(lengths, rows, layout, randn(t, 8, 64), randn(t, 8) * 0.5, randn(t, 1, 64),
                                randn(t, 1, 64))
        f32 = torch.float32
        tensors = on([x, dt, -torch.rand(8, generator=gen) - 0.5, B, C, torch.ones(8), torch.zeros(8)],
                     [dtype, dtype, f32, dtype, dtype, f32, f32])

        def call(x, ls, rows, b):
            xs, dt, A, B, C, D, dt_bias = x
            return mamba2_chunk_scan_varlen(xs, dt, A, B, C, 64, D=D, dt_bias=dt_bias, dt_softplus=True,
                                            seq_idx=seq_idx_of(ls, device, rows), backend=b)

        return tensors, [1, 1, None, 1, 1, None, None], call

    return {"varlen_attention": attention, "causal_conv1d_varlen": conv,
            "gated_delta_rule_varlen": delta_rule(gated_delta_rule_varlen, False),
            "kimi_delta_attention_varlen": delta_rule(kimi_delta_attention_varlen, True),
            "mamba2_chunk_scan_varlen": ssd}


def run_op(call, tensors, backend, dtype=None):
    """The outputs (one tensor, or a tuple flattened into one, fp32) of ``call(inputs, backend)`` and every input's
    gradient (None where unused) for seeded random output weights; ``dtype`` casts the float inputs first."""
    inputs = [(t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().requires_grad_()
              for t in tensors]
    outputs = call(inputs, backend)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator(device=outputs[0].device).manual_seed(1)
    weights = [torch.randn(o.shape, device=o.device, generator=generator, dtype=o.dtype) for o in outputs]
    grads = torch.autograd.grad(outputs, inputs, weights, allow_unused=True)
    return [torch.cat([o.float().reshape(-1) for o in outputs])] + [None if g is None else g.float() for g in grads]


def against_reference(call, tensors, backend, dtype) -> dict:
    """``backend``'s outputs and input gradients against the fp32 reference, each tensor apart, beside the
    reference's own error in ``dtype``, by flash-attention's rule: the kernel within 2x the same-dtype reference's
    error, or within the dtype's tolerance (the references compute in fp32, so their same-dtype error is only the
    output's rounding)."""
    kernel = run_op(call, tensors, backend)
    same = run_op(call, tensors, backends.REFERENCE)
    fp32 = run_op(call, tensors, backends.REFERENCE, torch.float32)
    per_tensor, ok = {}, finite(*kernel)
    for index, (k, s, f) in enumerate(zip(kernel, same, fp32)):
        if k is not None and f is not None:
            entry = {"kernel_vs_fp32": max_err(k, f), "reference_same_dtype_vs_fp32": max_err(s, f),
                     "relative": relative_err(k, f)}
            ok &= entry["kernel_vs_fp32"] <= 2 * entry["reference_same_dtype_vs_fp32"] + 1e-5 or (
                entry["relative"] <= TOLERANCE[dtype])
            per_tensor["out" if index == 0 else f"grad{index - 1}"] = entry
    return {"backend": backend, "dtype": str(dtype), "finite": finite(*kernel), "per_tensor": per_tensor,
            "relative_error": max(e["relative"] for e in per_tensor.values()), "ok": bool(ok)}


def max_err(a, b):
    return (a - b).abs().max().item()


def relative_err(a, b):
    """Largest |a - b| relative to the largest |b| (at least 1e-6)."""
    return max_err(a, b) / max(b.abs().max().item(), 1e-6)


def finite(*tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


# ------------------------------------------------------------------------------------------------ plumbing


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def describe(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(error)).strip()[-800:]


def guarded(context, check):
    """``check()``'s result with its wall time (``wall_s`` where it is a dict), or its error: a check that fails is a
    finding, recorded, and the run goes on."""
    start = time.perf_counter()
    try:
        result = check()
    except Exception as error:  # noqa: BLE001 - a check that fails is a finding: recorded, and the run goes on
        return {**context, "error": describe(error), "wall_s": round(time.perf_counter() - start, 2)}
    if isinstance(result, dict) and "wall_s" not in result:
        result = {**result, "wall_s": round(time.perf_counter() - start, 2)}
    return result


def environment(ctx: Context, hidden: dict) -> dict:
    info = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "compilepack": compilepack.__version__, "device": str(ctx.device), "simulated": ctx.simulate,
        "installed": {name: backends.is_installed(name) for name in KERNEL_BACKENDS},
        "versions": {name: backends.installed_version(name) for name in backends.FLOORS},
        "auto_backends": auto_outcome(),
        "admitted_backends": ctx.admitted, "checked_backends": ctx.chosen(),
        "refused_backends": ctx.refused, "hidden_from_stock": hidden,
    }
    info["triton"] = importlib.import_module("triton").__version__ if importlib.util.find_spec("triton") else None
    if ctx.cuda:
        info["gpu"] = torch.cuda.get_device_name(ctx.device)
        info["capability"] = list(torch.cuda.get_device_capability(ctx.device))
        info["memory_gb"] = round(torch.cuda.get_device_properties(ctx.device).total_memory / 2**30, 1)
    return info
