"""A GRPO step and a DPO step, packed against TRL's padded layout: ``python -m benchmarks.rl``.

The layouts, the steps and how they are timed: docs/benchmarks.md ("RL steps"). ``padded`` calls the model as the
trainers do; ``packed`` runs the same call through ``compilepack.integrations.rl_trainers.PackedModelCall``. Both
use the same patched model: without boundaries it runs stock's code.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F

import compilepack
from compilepack.integrations.rl_trainers import PackedModelCall
from compilepack.patching import family_named
from compilepack.testing import build_model

from .measure import synchronizer
from .rounds import round_order

MODES = ("padded", "packed")
PAD = 0


def build_models(family_name: str, widths: str, device: torch.device):
    """(policy, reference): two initialisations of the family's benchmark model (or its release's widths), patched,
    with TRL's fused head."""
    from trl.trainer.utils import add_fused_lm_head

    family = family_named(family_name)
    config = family.bench_config() if widths == "bench" else family.fixtures.checkpoint.config()
    policy = build_model(config, layers=None, seed=0, patch=False).to(device).train()
    # another initialisation, so that the losses depend on both models' log-probs
    reference = build_model(config, layers=None, seed=1, patch=False).to(device).requires_grad_(False)
    for model in (policy, reference):
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        compilepack.patch(model)
    return policy, reference


def spread(generator: torch.Generator, count: int, low: int, high: int, cut: float = 0.0) -> list[int]:
    """Log-uniform lengths in [low, high]; a fraction ``cut`` of them at ``high`` (cut at the maximum)."""
    u = torch.rand(count, generator=generator).tolist()
    cuts = torch.rand(count, generator=generator).tolist()
    return [high if c < cut else round(math.exp(math.log(low) + x * (math.log(high) - math.log(low))))
            for x, c in zip(u, cuts)]


def grpo_batch(vocab_size: int, prompts: int, group: int, max_completion: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = [n for n in spread(g, prompts, 16, 256) for _ in range(group)]
    completion_lengths = spread(g, prompts * group, 4, max_completion, cut=0.2)
    width_p, width_c = max(prompt_lengths), max(completion_lengths)
    ids = torch.full((len(prompt_lengths), width_p + width_c), PAD)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        ids[row, width_p - p:width_p + c] = torch.randint(1, vocab_size, (p + c,), generator=g)
        mask[row, width_p - p:width_p + c] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :width_p] = -100
    advantages = torch.randn(len(prompt_lengths), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "advantages": advantages,
            "completion_mask": mask[:, width_p:], "tokens": sum(prompt_lengths) + sum(completion_lengths)}


def dpo_batch(vocab_size: int, pairs: int, max_completion: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = spread(g, pairs, 16, 256) * 2
    completion_lengths = spread(g, 2 * pairs, 4, max_completion)
    lengths = [p + c for p, c in zip(prompt_lengths, completion_lengths)]
    ids = torch.full((2 * pairs, max(lengths)), PAD)
    mask, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, (p, n) in enumerate(zip(prompt_lengths, lengths)):
        ids[row, :n] = torch.randint(1, vocab_size, (n,), generator=g)
        mask[row, :n], completion[row, p:n] = 1, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(completion == 0, -100),
            "completion_mask": completion, "tokens": sum(lengths)}


def logps(call, batch: dict) -> torch.Tensor:
    return call(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                fused_lm_head=True).log_probs


def grpo_step(policy, reference, batch: dict, beta: float = 0.04, epsilon: float = 0.2) -> torch.Tensor:
    width_c = batch["completion_mask"].shape[1]
    with torch.no_grad():
        old = logps(policy, batch)[:, -width_c:]
        ref = logps(reference, batch)[:, -width_c:]
    new = logps(policy, batch)[:, -width_c:]
    ratio = torch.exp(new - old)
    advantages = batch["advantages"][:, None]
    objective = torch.min(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon) * advantages)
    kl = torch.exp(ref - new) - (ref - new) - 1
    mask = batch["completion_mask"]
    loss = ((-objective + beta * kl) * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach()


def dpo_step(policy, reference, batch: dict, beta: float = 0.1) -> torch.Tensor:
    with torch.no_grad():
        ref_chosen, ref_rejected = logps(reference, batch).sum(1).chunk(2)
    chosen, rejected = logps(policy, batch).sum(1).chunk(2)
    loss = -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()
    loss.backward()
    return loss.detach()


def run_step(step, mode, policy, reference, batch, device) -> float:
    """Seconds of one step; the policy's gradients cleared first."""
    sync = synchronizer(device)
    calls = (policy, reference) if mode == "padded" else (PackedModelCall(policy), PackedModelCall(reference))
    policy.zero_grad(set_to_none=True)
    sync()
    start = time.perf_counter()
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        step(*calls, batch)
    sync()
    return time.perf_counter() - start


def peak_mib(step, mode, policy, reference, batch, device) -> float:
    """Peak memory of one step above what was allocated before it, MiB."""
    policy.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_step(step, mode, policy, reference, batch, device)
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(step, mode, policy, reference, batch, device)
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    current = peak = 0
    for event in events:  # each op's own allocations (+) and frees (-), in time order
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak / 2**20


def measure(name: str, step, policy, reference, batch: dict, rounds: int, device) -> dict:
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    for mode in MODES:  # warm-up
        run_step(step, mode, policy, reference, batch, device)
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        # the policy's per-token log-probs, padded vs packed (the losses agree to their own rounding)
        logp_difference = (logps(policy, batch) - logps(PackedModelCall(policy), batch)).abs().max().item()
    times = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in round_order(list(MODES), r):  # alternating, as the default run's rounds
            times[mode].append(run_step(step, mode, policy, reference, batch, device))
    ratios = [a / b for a, b in zip(times["padded"], times["packed"])]
    return {
        "step": name, "rows": batch["input_ids"].shape[0], "tokens": batch["tokens"],
        "padded_tokens": batch["input_ids"].numel(),
        **{f"{mode}_s": statistics.median(times[mode]) for mode in MODES},
        "speedup": statistics.median(ratios),
        **{f"{mode}_peak_mib": peak_mib(step, mode, policy, reference, batch, device) for mode in MODES},
        "logp_difference": logp_difference,
    }


def table(rows: list[dict]) -> str:
    header = ("| family | step | rows | tokens (padded) | padded s | packed s | padded / packed | peak MiB padded "
              "| peak MiB packed | max logp diff |")
    lines = [f"| {r['family']} | {r['step']} | {r['rows']} | {r['tokens']} ({r['padded_tokens']}) | "
             f"{r['padded_s']:.3f} | {r['packed_s']:.3f} | {r['speedup']:.2f}x | {r['padded_peak_mib']:.0f} | "
             f"{r['packed_peak_mib']:.0f} | {r['logp_difference']:.1e} |" for r in rows]
    return "\n".join([header, "|" + " --- |" * 10, *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3_5"])
    parser.add_argument("--widths", choices=("bench", "real"), default="bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2, help="GRPO prompts per step")
    parser.add_argument("--group", type=int, default=8, help="GRPO completions per prompt")
    parser.add_argument("--pairs", type=int, default=4, help="DPO pairs per step")
    parser.add_argument("--max-completion", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for family_name in args.families:
        policy, reference = build_models(family_name, args.widths, device)
        vocab = policy.config.get_text_config().vocab_size
        steps = [("grpo", grpo_step, grpo_batch(vocab, args.prompts, args.group, args.max_completion)),
                 ("dpo", dpo_step, dpo_batch(vocab, args.pairs, args.max_completion))]
        for name, step, batch in steps:
            rows.append({"family": family_name, **measure(name, step, policy, reference, batch, args.rounds, device)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n{device.type}, {args.widths} widths, {args.rounds} paired rounds, completions up to "
          f"{args.max_completion} tokens\n")
    print(table(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
