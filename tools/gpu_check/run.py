"""GPU validation of the kernel paths: one prepared script, one JSON.

    python benchmarks/gpu_check.py --out gpu_check.json                     # on a CUDA machine (< 10 minutes)
    python benchmarks/gpu_check.py --device cpu --smoke --out smoke.json    # the same plumbing on CPU, seconds

(also ``python -m benchmarks gpu-check``; ``benchmarks/gpu_check.py`` is the entry, this package the check.)

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
4b. sequence ops: the sequence mode's state ops (fla, mamba-ssm) and gathered-key attention (flash-attn, torch's
   varlen) on a rank's slice (a document from an earlier rank, 1-token and empty documents, two rows), outputs,
   final states and gradients (the initial state's too) against the references (``gpu/sequence.py``);
5. families: a patched bench model per family in bf16, packed logits vs each document alone, explain
   (graphs/breaks), compiles over 6 varied HF batches, and a compiled (inductor) training step run under
   ``torch.cuda.set_sync_debug_mode("error")``: any device-to-host sync raises and is recorded with its op;
5b. QLoRA: a 4-bit bitsandbytes model per family, ``prepare_model_for_kbit_training``, LoRA on every linear
   layer, patched: graphs and breaks in train mode, compiles over 4 varied batches, compiled loss and LoRA
   gradients against eager (``lora.py``; without bitsandbytes the reason is the finding);
6. long rows: rows near the int32 limits the bugs name (mamba #1015/#1036, causal-conv1d #114; fla and flash-attn
   index in int64), where memory allows, each in a child process: the last document of a long row vs the same
   document alone, on the guarded path just below and just above the limit and on the library alone above it;
7. speed: tokens/s of patched compiled vs stock on the same HF-collated batches (stock: sdpa with the dense
   packed mask for attention-only models, right-padded batches for hybrids; FA2 padding-free when flash-attn
   is installed), each stock result naming the path stock ran (``stock_path``).

Every check records its error instead of stopping the run, so one JSON always comes back.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import compilepack

from .common import Budget, HEADLINE, environment, guarded
from .compiles import check_family, check_recompiles
from .long_rows import PROBES, check_long_rows
from .lora import check_qlora
from .ops import check_known_bugs, check_layouts, check_ops
from .sequence import check_sequence_ops
from .speed import measure_speed


# the sections in the order a full run takes them (the ops first: every later section builds on the kernels)
SECTIONS = ("ops", "layouts", "known_bugs", "recompiles", "sequence_ops", "families", "qlora", "long_rows", "speed")


def _probe_main(name: str, out: str) -> int:
    """Child process of :func:`run_probe`: run the probe, write its JSON (its error if it raised)."""
    function = PROBES[name][0]
    result = guarded({}, function)
    Path(out).write_text(json.dumps(result, indent=2))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--families", default=",".join(HEADLINE), help="comma list, or 'all'")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: exercise the plumbing in seconds")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (smoke: eager)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds after which no section starts (one started may run on: keep a margin)")
    parser.add_argument("--sections", default="all",
                        help=f"comma list of sections to run, of {','.join(SECTIONS)} (default all): a rerun on a "
                             "short device lease runs what the last one could not reach")
    parser.add_argument("--probe", choices=sorted(PROBES), help=argparse.SUPPRESS)  # a child process's one probe
    args = parser.parse_args(argv)
    if args.probe:
        return _probe_main(args.probe, args.out)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = [f.name for f in compilepack.families()] if args.families == "all" else args.families.split(",")
    started = time.perf_counter()
    budget = Budget(args.budget_s)
    sections = SECTIONS if args.sections == "all" else tuple(args.sections.split(","))
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; expected some of {','.join(SECTIONS)}")
    report = {"environment": environment(device)}
    backend = "eager" if args.smoke else args.compile_backend
    steps, tokens = (2, 512) if args.smoke else (8, 16384)
    run = {
        "ops": lambda: check_ops(device, dtype, [5, 1, 70] if args.smoke else [300, 1, 64, 1024, 17, 700]),
        "layouts": lambda: budget.run(30, lambda: check_layouts(device, dtype, args.smoke), {}),
        "known_bugs": lambda: budget.run(30, lambda: check_known_bugs(device, dtype, budget), {}),
        "recompiles": lambda: budget.run(30, lambda: check_recompiles(device, dtype, args.smoke), {}),
        "sequence_ops": lambda: budget.run(40, lambda: check_sequence_ops(device, dtype, args.smoke), {}),
        "families": lambda: [budget.run(60, lambda n=n: check_family(n, device, dtype, args.smoke, backend),
                                        {"family": n}) for n in names],
        "qlora": lambda: [budget.run(60, lambda n=n: check_qlora(n, device, backend), {"family": n}) for n in names],
        "long_rows": lambda: check_long_rows(device, budget),
        "speed": lambda: [budget.run(45, lambda n=n: measure_speed(n, device, dtype, steps, tokens, backend,
                                                                   args.smoke), {"family": n}) for n in names],
    }
    for section in sections:
        report[section] = run[section]()
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0

