"""The run's outputs: JSON (every figure), a markdown table with ratios and bars, a PNG plot, a console table."""

from __future__ import annotations

import pathlib
import statistics

from .bars import paired_ratios, tokens_per_s
from .modes import MODE_NAMES, PADDED_MODES

RATIO_BASES = PADDED_MODES  # every mode is also shown as a multiple of each stock padded mode
STATUS_RULE = ("Status: a bar decided in every round is met if every round's ratio reaches the target, missed if "
               "none does, not decided otherwise; a bar decided on the median is met or missed by the median alone.")


def cell(value, spec: str) -> str:
    """``value`` formatted with ``spec`` for a table cell, ``-`` when there is none."""
    return "-" if value is None else spec.format(value)


def text_cell(text: str, limit: int = 160) -> str:
    """Free text (an error message) made safe for a table cell."""
    return text.replace("|", "\\|")[:limit]


def add_ratios(results: list[dict]) -> None:
    """``speedup_vs``: the median over rounds of this mode's tokens/s over each stock padded mode's in the same
    round, for the same family (``speedup_vs_range``: their min and max)."""
    for result in results:
        by_mode = {r["mode"]: r for r in results if r["family"] == result["family"]}
        result["speedup_vs"], result["speedup_vs_range"] = {}, {}
        for base in RATIO_BASES:
            ratios = []
            if tokens_per_s(by_mode, result["mode"]) and tokens_per_s(by_mode, base):
                ratios = paired_ratios(result, by_mode[base])
            result["speedup_vs"][base] = round(statistics.median(ratios), 2) if ratios else None
            result["speedup_vs_range"][base] = [round(min(ratios), 2), round(max(ratios), 2)] if ratios else None


def range_cell(value, low, high, spec: str, suffix: str = "") -> str:
    """``median [min-max]`` formatted with ``spec`` (the range left out where it is one value), or ``-``."""
    if value is None:
        return "-"
    if low is None or high is None or low == high:
        return f"{value:{spec}}{suffix}"
    return f"{value:{spec}}{suffix} [{low:{spec}}-{high:{spec}}]"


def tokens_cell(r: dict) -> str:
    return range_cell(r.get("tokens_per_s") or None, r.get("tokens_per_s_min"), r.get("tokens_per_s_max"), ".0f")


def _speedup_cell(r: dict, base: str) -> str:
    low, high = (r.get("speedup_vs_range") or {}).get(base) or (None, None)
    return range_cell((r.get("speedup_vs") or {}).get(base), low, high, ".2f", "x")


def bar_value_cell(bar: dict) -> str:
    return range_cell(bar["value"], bar.get("min"), bar.get("max"), ".2f")


def markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [
        f"# compilepack bench: {report['device']} ({report['device_name']}), {report['date']}",
        "",
        (f"torch {report['torch']}, transformers {report['transformers']}, compilepack {report['compilepack']}; "
         f"{report['threads']} threads on {report['cores']} cores; compile backend `{settings['compile_backend']}`; "
         f"{settings['config']} configs; {settings['tokens_per_step']} real tokens per step at most; "
         f"{settings['warmup_steps']} warm-up step + {settings['steps']} timed rounds per mode, round-robin across "
         f"a family's warm workers (round r starts at mode r; warm-up {settings['warmup']}, "
         f"{settings['compile_lanes']} compiles at a time; rounds interleaved step by step, the patched modes "
         f"training on their round's arrival step {settings['patched_steps_per_round']} times); "
         f"inductor cache: {settings['inductor_cache']}; dynamo `specialize_float={settings['specialize_float']}` "
         f"(stock and patched alike); allocator `{settings['allocator']}`; "
         f"{settings['widths']} widths; run wall time {report['wall_s']:.0f} s; "
         f"1-minute load average during the timed steps {_load_range(report['results'])}."),
        "",
        _modes_line(settings),
        "",
        _workload_line(report["workload"]),
        "",
        ("Figures are the median over the timed rounds [min-max]; ratios are paired per round (a mode's tokens/s "
         "over the other's in the same round)."),
        "",
        ("| family | mode | tokens/s | x padded eager | x padded compiled | x grouped | x grouped compiled | compile s "
         "(CPU s) | graphs / breaks | compiles | peak MB | max logit diff | padding | error / note |"),
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    lines += ["| " + " | ".join(_row_cells(r, _diff(r), _issue(r))) + " |" for r in report["results"]]
    lines += ["", "## Bars", "",
              STATUS_RULE, "", "| family | bar | median [min-max] | target | status | decided on | detail |",
              "|---|---|--:|--:|---|---|---|"]
    lines += [_bar_row(b) for b in report["bars"]]
    lines += utilization_section(report)
    return "\n".join(lines) + "\n"


# The table keeps the columns of the time split (one extra eager step timed by part), which went with the
# real-width runs (docs/benchmarks.md, "Real widths"): a run's table reads as before, "-" in each.
SPLIT_PARTS = ("mixers", "mlp", "lm_head", "loss", "optimizer", "other")


def utilization_section(report: dict) -> list[str]:
    """Per mode: tokens/s, peak memory, model FLOPs per second and MFU against the matmul throughput measured in
    the run."""
    results = [r for r in report["results"] if r.get("mfu") is not None]
    if not results:
        return []
    matmul = report.get("matmul") or []
    measured = ", ".join(f"{m['gflops_best']:.0f} (median {m['gflops_median']:.0f})" for m in matmul)
    lines = ["", "## Time split, memory and utilization", "",
             (f"fp32 matmul throughput measured in this run ({matmul[0]['shape']}, {matmul[0]['threads']} threads, "
              f"best of 5 at the start and at the end): {measured} GFLOP/s; MFU is the modes' useful model FLOPs "
              "per second (linear layers: 6 per weight and token, 4 for a frozen weight; causal softmax attention "
              "per document; the linear mixers' state math not counted; real tokens only) over the better of "
              "the two." if matmul else "No matmul throughput measured (not a CPU run): no MFU."),
             "",
             ("Time split: one extra eager step (the last round's last batch), each part's forward and backward "
              "timed with hooks; share of that step [seconds]."),
             "",
             "| family | mode | tokens/s | peak MB | model GFLOP/s | MFU | " + " | ".join(SPLIT_PARTS) + " | step s |",
             "|---|---|--:|--:|--:|--:|" + "--:|" * len(SPLIT_PARTS) + "--:|"]
    return lines + [f"| {r['family']} | {r['mode']} | {tokens_cell(r)} | {cell(r.get('peak_mem_mb'), '{:.0f}')} "
                    f"| {cell(r.get('model_gflops_per_s'), '{:.1f}')} | {cell(r.get('mfu'), '{:.0%}')} |"
                    + " - |" * (len(SPLIT_PARTS) + 1) for r in results]


def compile_cell(r: dict) -> str:
    """The cold compile's wall seconds, with its CPU seconds (the process and its compile workers) in brackets:
    wall time grows when compiles share the cores, CPU time does not."""
    text = cell(r.get("compile_s"), "{:.1f}")
    return text + (f" ({r['compile_cpu_s']:.1f})" if r.get("compile_cpu_s") is not None else "")


def _load_range(results: list[dict]) -> str:
    loads = [step["load_avg"] for r in results for step in r.get("timed") or [] if step.get("load_avg") is not None]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "unknown"


def _modes_line(settings: dict) -> str:
    text = f"Modes ({settings['mode_set']}): {', '.join(settings['modes'])}."
    left_out = settings["left_out"]
    if left_out:
        text += " Left out (`--full` runs them): " + "; ".join(f"`{m}`: {why}" for m, why in left_out.items()) + "."
    return text


def _workload_line(workload: dict) -> str:
    return (
        f"Documents: {workload['timed_docs']} in the timed steps, lengths {workload['length_mix']} "
        f"(median {workload['median_len']}, mean {workload['mean_len']:.0f}, max {workload['max_len']}); "
        f"real tokens per timed step {workload['real_tokens_per_step']}; arrival-order padded batches are "
        f"{100 * workload['arrival_padding_frac']:.0f}% padding "
        f"(padded/real {workload['arrival_padded_over_real']:.2f})."
    )


def _row_cells(r: dict, diff: str, issue: str) -> list[str]:
    """A mode's cells, in the markdown table's and the console table's column order."""
    return [r["family"], r["mode"], tokens_cell(r), *(_speedup_cell(r, base) for base in RATIO_BASES),
            compile_cell(r), "-" if r.get("graphs") is None else f"{r['graphs']} / {r['graph_breaks']}",
            cell(r.get("compiles"), "{}"), cell(r.get("peak_mem_mb"), "{:.0f}"), diff,
            cell(r.get("padding_frac"), "{:.0%}"), issue]


def _bar_row(bar: dict) -> str:
    state = "**missed**" if bar["status"] == "missed" else bar["status"]
    return (f"| {bar['family']} | {bar['bar']} | {bar_value_cell(bar)} | {bar['target']} | {state} "
            f"| {bar['rule']} | {text_cell(bar['detail'], 300)} |")


def _diff(r: dict) -> str:
    text = cell(r.get("max_logit_diff"), "{:.1e}")
    leak = r.get("max_logit_diff_position_ids_only")
    return text if leak is None else f"{text} (position_ids only: {leak:.1e})"


def _issue(r: dict) -> str:
    return text_cell(r.get("error") or r.get("note") or "")


def plot(report: dict, path: pathlib.Path) -> None:
    """Grouped bars: median tokens/s per family and mode (log scale), error bars from the fastest to the slowest
    round; a mode without a figure is marked 'x'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    results = report["results"]
    families = list(dict.fromkeys(r["family"] for r in results))
    modes = [m for m in MODE_NAMES if any(r["mode"] == m for r in results)]
    width = 0.8 / len(modes)
    figure, axes = plt.subplots(figsize=(max(8, 2.2 * len(families) + 3), 5))
    colors = plt.get_cmap("tab10")
    handles = []
    for index, mode in enumerate(modes):
        xs, ys, spread, missing = [], [], [[], []], []
        for position, family in enumerate(families):
            by_mode = {r["mode"]: r for r in results if r["family"] == family}
            x = position - 0.4 + width * (index + 0.5)
            value = tokens_per_s(by_mode, mode)
            if value:
                xs.append(x)
                ys.append(value)
                spread[0].append(value - (by_mode[mode].get("tokens_per_s_min") or value))
                spread[1].append((by_mode[mode].get("tokens_per_s_max") or value) - value)
            else:
                missing.append(x)
        axes.bar(xs, ys, width, color=colors(index), yerr=spread, ecolor="black", capsize=2,
                 error_kw={"elinewidth": 0.8})
        # a missing figure is an 'x' at the foot of the axis (x in data, y in axes coordinates)
        axes.plot(missing, [0.03] * len(missing), "x", color=colors(index), markersize=9, mew=2,
                  transform=axes.get_xaxis_transform())
        handles.append(Patch(color=colors(index), label=mode))
    axes.set_yscale("log")
    axes.set_xticks(range(len(families)), families)
    axes.set_ylabel("real tokens / s (training step, log scale)")
    axes.set_title(f"compilepack bench, {report['device']} ({report['threads']} threads), {report['date']}"
                   "\nmedian of the timed rounds, whiskers: min-max; x: no figure (error or time limit)")
    axes.legend(handles=handles, fontsize=8, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_console(report: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"compilepack bench ({report['device']}, {report['date']})", show_lines=False)
    for column in ("family", "mode", "tok/s", "x pad eager", "x pad comp", "x grouped", "x grp comp", "compile s",
                   "graphs/brk", "compiles", "peak MB", "max diff", "padding"):
        table.add_column(column, no_wrap=True)
    table.add_column("error / note", overflow="fold", min_width=24)
    for r in report["results"]:
        table.add_row(*_row_cells(r, cell(r.get("max_logit_diff"), "{:.1e}"), escape(_issue(r)[:60])))
    console = Console(width=max(Console().width, 200))  # a narrow or piped terminal would fold every cell
    console.print(table)
    console.print("tok/s and ratios: median over the timed rounds [min-max], ratios paired per round. "
                  + STATUS_RULE, highlight=False, markup=False)
    for bar in report["bars"]:
        state = {"met": "[green]met[/]", "missed": "[red]missed[/]", "not decided": "[yellow]not decided[/]",
                 "n/a": "[dim]n/a[/]"}[bar["status"]]
        console.print(f"{bar['family']:>11}  {state}  {escape(bar['bar'])}: {bar_value_cell(bar)} "
                      f"(target {bar['target']}, {bar['rule']}) {escape(bar['detail'])}",
                      highlight=False)
    left_out = report["settings"]["left_out"]
    if left_out:
        console.print(f"Left out of this run (--full runs them): {', '.join(left_out)}", highlight=False)

