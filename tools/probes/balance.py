"""The imbalance table of docs/context-parallel-evidence.md: arrival-order dealing against
``compilepack.distributed.BalancedBatchSampler`` on the benchmark's document mix (20 000 documents).

    python -m tools.probes.balance
"""

from __future__ import annotations

from compilepack.distributed import imbalance_report

from benchmarks.data import LengthMix


def main() -> None:
    lengths = LengthMix().sample(20000, seed=0)
    print("| ranks | tokens per rank | attention_length | steps | before: mean / worst | after: mean / worst |")
    print("| --- | --- | --- | --- | --- | --- |")
    for ranks in (2, 4, 8):
        for tokens_per_rank in (4096, 8192):
            for attention_length in (12 * 4096, 2048):
                r = imbalance_report(lengths, ranks, tokens_per_rank, attention_length)
                print(f"| {ranks} | {tokens_per_rank} | {attention_length} | {r['steps']} | {r['before_mean']:.3f} / "
                      f"{r['before_max']:.3f} | {r['after_mean']:.4f} / {r['after_max']:.4f} |")


if __name__ == "__main__":
    main()
