"""Measure what stock transformers does with a packed batch, per family, and write docs/models.md.

For every registered family (its bench model, fp32, CPU) the same packed documents are run
- stock, HF collator batch (boundary kwargs), config defaults (use_cache=True),
- stock, position_ids only, use_cache=False (what the HF Trainer does with a position-ids-only collator),
- patched, HF collator batch,
and each is compared with every document run alone (max |logit difference|), or the error it raises.

    python -m compilepack.bench.models_doc            # print the table
    python -m compilepack.bench.models_doc --write    # regenerate docs/models.md
"""

from __future__ import annotations

import argparse
import copy
import random
from pathlib import Path

import torch
import transformers
from transformers import DataCollatorWithFlattening

import compilepack

from .configs import build_bench_model

# What each CUDA backend runs for the family, and what stock transformers does with its packed batches.
KERNELS = {
    "bamba": "conv: causal-conv1d causal_conv1d_fn(seq_idx); scan: mamba-ssm mamba_chunk_scan_combined(seq_idx); "
        "attention: flash-attn / torch varlen",
    "falcon_h1": "conv: causal-conv1d causal_conv1d_fn(seq_idx); scan: mamba-ssm mamba_chunk_scan_combined(seq_idx); "
        "attention: flash-attn / torch varlen",
    "falcon_mamba": (
        "conv: causal-conv1d causal_conv1d_fn(seq_idx); selective scan: compilepack's reference on every "
        "device (mamba-ssm's selective scan cannot reset inside a row); fused mamba_inner_fn: never on "
        "packed batches"
    ),
    "granitemoehybrid": "conv: causal-conv1d causal_conv1d_fn(seq_idx); scan: mamba-ssm mamba_chunk_scan_combined(seq_idx); "
        "attention: flash-attn / torch varlen",
    "jamba": "conv: causal-conv1d causal_conv1d_fn(seq_idx); selective scan: compilepack's reference on every "
        "device (mamba-ssm's selective scan cannot reset inside a row); attention: flash-attn / torch varlen",
    "kimi_linear": "conv: causal-conv1d; KDA: fla chunk_kda (chunk_kda_fwd/bwd); MLA attention (values padded to the "
        "q/k head dim inside the op): flash-attn / torch varlen",
    "lfm2": "short conv: causal-conv1d; attention: flash-attn / torch varlen",
    "lfm2_moe": "short conv: causal-conv1d; attention: flash-attn / torch varlen",
    "lfm3": "short conv: causal-conv1d only for kernel widths 2-4 (LFM3's default 7 runs the reference); "
        "attention (full and sliding window): flash-attn / torch varlen",
    "llama": "attention: flash-attn varlen, else torch varlen_attn (CUDA); per-document CPU flash kernel (CPU)",
    "mamba": (
        "conv: causal-conv1d causal_conv1d_fn(seq_idx); selective scan: compilepack's reference on every "
        "device (mamba-ssm's selective scan cannot reset inside a row); fused mamba_inner_fn: never on "
        "packed batches"
    ),
    "mamba2": "conv: causal-conv1d causal_conv1d_fn(seq_idx); scan: mamba-ssm mamba_chunk_scan_combined(seq_idx)",
    "mistral": "attention (sliding window): flash-attn varlen, else torch varlen_attn (CUDA); CPU per-document",
    "nemotron_h": "conv: causal-conv1d causal_conv1d_fn(seq_idx); scan: mamba-ssm mamba_chunk_scan_combined(seq_idx); "
        "attention: flash-attn / torch varlen",
    "olmo_hybrid": "conv: causal-conv1d; delta rule: fla chunk_gated_delta_rule; attention: flash-attn / torch varlen",
    "qwen2": "attention: flash-attn varlen, else torch varlen_attn (CUDA); CPU per-document",
    "qwen3": "attention: flash-attn varlen, else torch varlen_attn (CUDA); CPU per-document",
    "qwen3_5": "conv: causal-conv1d; delta rule: fla chunk_gated_delta_rule; attention: flash-attn / torch varlen",
    "qwen3_5_moe": "conv: causal-conv1d; delta rule: fla chunk_gated_delta_rule; attention: flash-attn / torch varlen",
    "qwen3_next": "conv: causal-conv1d; delta rule: fla chunk_gated_delta_rule; attention: flash-attn / torch varlen",
    "zamba2": "conv: causal-conv1d causal_conv1d_fn(seq_idx); scan: mamba-ssm mamba_chunk_scan_combined(seq_idx); "
        "attention: flash-attn / torch varlen",
}

STOCK_PACKED = {
    "bamba": "position_ids only: silently wrong (Mamba2 layers scan one long sequence); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "falcon_h1": "position_ids only: silently wrong (the Mamba2 half of every layer scans one long sequence); with the "
        "collator's boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "falcon_mamba": (
        "position_ids only or with the collator's boundary kwargs: silently wrong (the kwargs never reach "
        "the mixers; every layer scans one long sequence)"
    ),
    "granitemoehybrid": "position_ids only: silently wrong (Mamba2 layers scan one long sequence); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "jamba": "position_ids only: silently wrong in the Mamba layers (they scan one long sequence); with the "
        "collator's boundary kwargs: silently wrong (they never reach the mixers; with the default "
        "use_cache=True the attention leaks too)",
    "kimi_linear": "position_ids only: silently wrong (KDA layers see one long sequence); with the collator's boundary "
        "kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "lfm2": "position_ids only: silently wrong (short convs reach across document starts); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "lfm2_moe": "position_ids only: silently wrong (short convs reach across document starts); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "lfm3": "position_ids only: silently wrong (short convs reach across document starts); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "llama": "sdpa/eager: correct only with use_cache=False, via a dense T x T mask built from position_ids",
    "mamba": (
        "position_ids only or with the collator's boundary kwargs: silently wrong (the kwargs never reach "
        "the mixers; every layer scans one long sequence)"
    ),
    "mamba2": "position_ids only: silently wrong (one long scan); boundary kwargs: dropped by Mamba2ForCausalLM "
        "before the backbone, silently wrong",
    "mistral": "sdpa: dense T x T mask from position_ids, correct only with use_cache=False",
    "nemotron_h": "position_ids only: silently wrong (Mamba2 blocks scan one long sequence); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "olmo_hybrid": "position_ids only: silently wrong (linear layers see one long sequence); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "qwen2": "sdpa: dense T x T mask from position_ids, correct only with use_cache=False",
    "qwen3": "sdpa: dense T x T mask from position_ids, correct only with use_cache=False",
    "qwen3_5": "position_ids only: silently wrong (linear layers see one long sequence); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "qwen3_5_moe": "position_ids only: silently wrong (linear layers see one long sequence); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "qwen3_next": "position_ids only: silently wrong (linear layers see one long sequence); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
    "zamba2": "position_ids only: silently wrong (Mamba2 layers scan one long sequence); with the collator's "
        "boundary kwargs: ValueError (causal_conv1d_fn can't keep packed sequences apart)",
}

LENGTHS = [70, 1, 23, 5, 40]
DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "models.md"
HEADER = """# Supported model families

Generated by `python -m compilepack.bench.models_doc --write` (transformers {tf}, torch {torch}, CPU, fp32, the
benchmark's random models: documents of {lengths} tokens packed in one row). "Error" columns give the largest
|logit difference| between a packed document and the same document run alone; a stock cell may instead name
the exception it raised.

Every family passes `tests/patches/test_families.py`: packed == each document alone (logits and gradients),
one graph and no breaks forward and forward+backward, one compile over 10 varied batches with `dynamic=True`,
one compile with fixed-shape `PackedCollator` batches. On CPU every op runs its pure-torch reference; the CUDA
column names the library each op calls on CUDA when it is installed (otherwise the reference runs there too).

"""


def measure(family) -> dict:
    torch.manual_seed(0)
    stock = build_bench_model(family.name).eval()
    patched = compilepack.patch(copy.deepcopy(stock))
    vocab = stock.config.get_text_config().vocab_size
    rng = random.Random(0)
    docs = [[rng.randrange(1, vocab) for _ in range(n)] for n in LENGTHS]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": d} for d in docs]
    )
    positions_only = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    with torch.no_grad():
        alone = [stock(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in docs]
        return {
            "stock, boundary kwargs": _error(stock, batch, alone),
            "stock, position_ids only": _error(stock, positions_only, alone),
            "patched": _error(patched, batch, alone),
        }


def _error(model, batch, alone) -> str:
    try:
        logits = model(**batch).logits[0]
    except Exception as error:  # stock refuses some packed batches: that is the finding
        return f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
    cu = [0]
    for piece in alone:
        cu.append(cu[-1] + piece.shape[0])
    return f"{max((logits[s:e] - a).abs().max().item() for s, e, a in zip(cu[:-1], cu[1:], alone)):.1e}"


def table() -> str:
    lines = [
        "| family (`model_type`) | transformers | patched layers (globals rebound) | CUDA kernels | "
        "stock, boundary kwargs | stock, position_ids only | patched |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for family in compilepack.families():
        layers = "; ".join(f"{cls}: {', '.join(r.global_name for r in reps)}" for cls, reps in family.layers.items())
        cells = measure(family) if family.available else dict.fromkeys(("stock, boundary kwargs",
                                                                        "stock, position_ids only", "patched"), "-")
        lines.append(
            f"| `{family.name}` | {family.supported_transformers} | {layers} | {KERNELS[family.name]} | "
            f"{cells['stock, boundary kwargs']} | {cells['stock, position_ids only']} | {cells['patched']} |"
        )
    return "\n".join(lines)


# The family tests (tests/patches, every registered family the release has) per transformers release, as run with
# tests/check_transformers.sh <release>; CI runs test_families.py on the oldest and the whole suite on the newest.
RELEASES = """## Transformers releases

compilepack admits transformers {supported}. Every family is tested on every release it exists in (LFM3 from
5.23); `tests/check_transformers.sh <release>` runs the family tests for one release in a scratch environment,
the step to take before widening the range or admitting a new release. Results, 2026-12-01:

| release | families | tests run | result |
| --- | --: | --- | --- |
{rows}

Before 5.23 the mixture-of-experts variants' forward+backward graph count is an expected failure (a strict xfail
in the tests): their experts run, on CPU, transformers' own `grouped_mm` fallback, whose backward calls
`.item()`, a graph break in stock code outside the layers compilepack patches (on CUDA torch's native
`grouped_mm` runs; from 5.23 the fallback compiles). Everything else, graph counts of the patched layers included,
passes on every release.
"""

# release -> (families tested, what ran, result), from tests/check_transformers.sh runs on 2026-12-01 (5.18-5.19 ran
# before the MoE graph counts became a strict xfail: their 8 failures are exactly those cases)
RELEASE_RESULTS = {
    "5.18.0": ("20", "tests/patches", "309 passed, 1 skipped; 8 failed = the MoE forward+backward graph counts (xfail)"),
    "5.19.0": ("20", "tests/patches", "309 passed, 1 skipped; 8 failed = the MoE forward+backward graph counts (xfail)"),
    "5.20.2": ("20", "tests/patches", "309 passed, 1 skipped, 8 xfailed"),
    "5.21.1": ("20", "test_families.py", "184 passed, 8 xfailed"),
    "5.22.2": ("20", "test_families.py", "184 passed, 8 xfailed"),
    "5.23.0": ("21", "test_families.py", "200 passed"),
    "5.24.0": ("21", "the whole suite (CI)", "every test passes"),
}

# Measured with tests/patches/test_plain_batches.py's row (2026-12-01, transformers 5.24.0): stock on a
# position_ids-only packed row, and what the patched model does with it.
POSITIONS_ONLY = """## Packed rows without boundaries

A packed row whose documents are marked only by restarting `position_ids` (no boundary kwargs) is never inferred
by compilepack. Where stock transformers keeps those documents apart by itself, the patched model runs stock's own
code on it, exactly as stock; where stock would mix them, the patched model refuses the batch (`BoundaryError`
eager; a device assert naming the rule when compiled). Stock's max |logit| error against each document alone, on
such a row (tiny first variant, fp32, documents [9, 1, 14, 6]; `tests/patches/test_plain_batches.py` checks the rule
for every family):

| family | stock, `use_cache=False` | stock, `use_cache=True` (the configs' default) | patched |
| --- | --: | --: | --- |
| `bamba` | 4.5e-01 | 5.9e-01 | refused |
| `falcon_h1` | 1.0e-03 | 4.9e-01 | refused |
| `falcon_mamba` | 2.3e+00 | 2.3e+00 | refused |
| `granitemoehybrid` | 5.3e-01 | 5.3e-01 | refused |
| `jamba` | 4.1e-03 | 5.3e-01 | refused |
| `kimi_linear` | 2.1e-01 | 4.0e-01 | refused |
| `lfm2` | 7.6e-04 | 6.2e-01 | refused |
| `lfm2_moe` | 5.7e-04 | 4.9e-01 | refused |
| `lfm3` | 4.9e-01 | 7.5e-01 | refused |
| `llama` | 1.8e-07 | 5.8e-01 | stock |
| `mamba` | 2.2e+00 | 2.2e+00 | refused |
| `mamba2` | 3.4e+00 | 3.4e+00 | refused |
| `mistral` | 1.8e-07 | 5.2e-01 | stock |
| `nemotron_h` | 3.4e-01 | 4.8e-01 | refused |
| `olmo_hybrid` | 1.0e-01 | 8.0e-01 | refused |
| `qwen2` | 2.1e-07 | 5.1e-01 | stock |
| `qwen3` | 2.4e-07 | 6.1e-01 | stock |
| `qwen3_5` | 5.3e-02 | 3.3e-01 | refused |
| `qwen3_5_moe` | 4.5e-02 | 3.2e-01 | refused |
| `qwen3_next` | 6.9e-02 | 3.6e-01 | refused |
| `zamba2` | 6.8e-01 | 6.8e-01 | refused |

"stock" runs stock's code when the call builds no cache (`use_cache=False`, as HF Trainer sets it) and refuses
otherwise: with a cache stock skips its packed-row detection and mixes the documents. Batches with the collator's
boundary kwargs never take this path.
"""


# How each CUDA kernel path is verified (docs/benchmarks.md says how to run each).
KERNEL_VERIFICATION = """## How the kernel paths are verified

| path | recording fake (CPU, every CI run) | real kernels on CPU (CI's kernel stage, Triton interpreter) | GPU (`benchmarks/gpu_check.py`) |
| --- | --- | --- | --- |
| attention: flash-attn varlen | argument contract, results through the reference | - (CUDA C++) | not yet run (no GPU lent) |
| attention: torch `varlen_attn` | argument contract | - (CUDA only) | not yet run |
| causal conv1d: causal-conv1d | argument contract, channel-last layouts | - (CUDA C++) | not yet run |
| gated delta rule: fla 0.6 `chunk_gated_delta_rule_fwd/bwd` | argument contract, host copy of the boundaries | forward and every gradient == the reference; saved tensors == the fake | not yet run |
| Kimi delta attention: fla 0.6 `chunk_kda_fwd/bwd` | argument contract | one case, forward and every gradient; saved tensors == the fake | not yet run |
| Mamba2 scan: mamba-ssm 2.3.2 `mamba_chunk_scan_combined` | argument contract | forward and every gradient == the reference; output == the fake | not yet run |
| selective scan | - (no library resets inside a row: the reference runs on CUDA) | - | - |
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"write {DOCS_PATH}")
    args = parser.parse_args()
    text = table()
    if args.write:
        header = HEADER.format(tf=transformers.__version__, torch=torch.__version__, lengths=LENGTHS)
        DOCS_PATH.write_text(
            header + text + "\n\n" + _notes() + "\n" + POSITIONS_ONLY + "\n" + _releases() + "\n" + KERNEL_VERIFICATION
        )
    print(text)


def _releases() -> str:
    from compilepack.patching.family import TESTED_TRANSFORMERS

    rows = "\n".join(f"| {release} | {families} | {tests} | {result} |"
                     for release, (families, tests, result) in RELEASE_RESULTS.items())
    return RELEASES.format(supported=TESTED_TRANSFORMERS, rows=rows)


def _notes() -> str:
    return "\n".join(f"- `{f.name}`: {STOCK_PACKED[f.name]}" for f in compilepack.families()) + "\n"


if __name__ == "__main__":
    main()
