"""The Hopper probes (issue 49, item 5; listed in docs/benchmarks.md), in one child process, so that fla runs there
only (the check's own process never runs a refused fla) and a fault cannot end the run. fla 0.6.0 has no escape from
its #640 guard, so the child sets ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1`` (the guard's only input that is not
the GPU) to True. Simulated (on CPU), the same code runs with the references standing in for the kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch

from compilepack.ops import backends

from .common import Context, admitted_backends, against_reference, describe, guarded, op_cases
from .ops import check_layout
from .sequence import ATTENTION_LENGTHS, SIMULATED_ATTENTION_LENGTHS, attention_case


def bypass_fla_640() -> str:
    """Turn off fla's #640 guard in this process; what was done, in words."""
    try:
        from fla.ops.common import chunk_o
    except ImportError as error:
        return f"fla not importable ({describe(error)}): the reference stands in"
    if getattr(chunk_o, "TRITON_ABOVE_3_7_1", True):
        return "fla's #640 guard is not active here (Triton >= 3.7.1)"
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return "fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 set to True in the probe's process"


def hopper_probes(device, dtype, simulate) -> dict:
    device = torch.device(device)
    result = {"fla_guard": bypass_fla_640(), "torch": torch.__version__}
    fla = backends.REFERENCE if simulate or not backends.is_installed("fla") else "fla"
    for head_dim in (64, 128):
        make = op_cases(device, head_dim)["gated_delta_rule_varlen"]
        result[f"gdn_head_dim_{head_dim}"] = guarded({}, lambda m=make: check_layout(
            "gated_delta_rule_varlen", fla, "chunk-size-pm-1", m, dtype, simulate))
    make = op_cases(device)["kimi_delta_attention_varlen"]
    result["kda_padding_document"] = guarded({}, lambda: check_layout(
        "kimi_delta_attention_varlen", fla, "padding-document", make, dtype, simulate))
    admitted, refused = admitted_backends()
    if simulate or "torch_varlen" in admitted["varlen_attention"]:
        backend = backends.REFERENCE if simulate else "torch_varlen"
        lengths = SIMULATED_ATTENTION_LENGTHS if simulate else ATTENTION_LENGTHS
        result["gathered_keys_equal_heads"] = guarded({}, lambda: against_reference(
            *attention_case(lengths, device, 8 if simulate else 64, kv_heads=8), backend, dtype))
    else:
        result["gathered_keys_equal_heads"] = {"refused": refused.get("varlen_attention:torch_varlen", "not installed")}
    return result


def run_hopper_probes(ctx: Context) -> dict:
    """The probes in a child process (``python -m tools.gpu_check --probe hopper``) on a Hopper GPU, given what is
    left of the budget (30 to 300 s); recorded as skipped on other GPUs."""
    timeout_s = max(30.0, min(300.0, ctx.budget.left()))
    if ctx.simulate:  # in this process: the probes' code is the same, the child's entry is tested on its own
        return hopper_probes(ctx.device, ctx.dtype, simulate=True)
    if not (ctx.cuda and torch.cuda.get_device_capability(ctx.device)[0] == 9):
        return {"skipped": "Hopper GPUs only"}
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "probe.json")
        command = [sys.executable, "-m", "tools.gpu_check", "--probe", "hopper", "--out", out,
                   "--device", str(ctx.device)]
        try:
            done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout_s,
                                  cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        except subprocess.TimeoutExpired:
            return {"error": f"the probe's process ran past {timeout_s:.0f} s"}
        if not os.path.exists(out):
            return {"error": f"the probe's process exited {done.returncode}", "log": done.stderr[-1500:]}
        with open(out) as file:
            return json.load(file)
