"""The run's outputs: JSON (every figure), a markdown table with ratios and bars, a PNG plot, a console table."""

from __future__ import annotations

import json
import pathlib

from .bars import tokens_per_s
from .markdown import cell, text_cell
from .modes import MODE_NAMES, PADDED_MODES

RATIO_BASES = PADDED_MODES  # every mode is also shown as a multiple of each stock padded mode


def add_ratios(results: list[dict]) -> None:
    """``speedup_vs``: this mode's tokens/s over each stock padded mode's, for the same family."""
    for result in results:
        by_mode = {r["mode"]: r for r in results if r["family"] == result["family"]}
        mine = tokens_per_s(by_mode, result["mode"])
        result["speedup_vs"] = {
            base: (round(mine / tokens_per_s(by_mode, base), 2) if mine and tokens_per_s(by_mode, base) else None)
            for base in RATIO_BASES
        }


def write_json(report: dict, path: pathlib.Path) -> None:
    path.write_text(json.dumps(report, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------ markdown


def markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [
        f"# compilepack bench: {report['device']} ({report['device_name']}), {report['date']}",
        "",
        f"torch {report['torch']}, transformers {report['transformers']}, compilepack {report['compilepack']}; "
        f"{report['threads']} threads on {report['cores']} cores; compile backend `{settings['compile_backend']}`; "
        f"{settings['config']} configs; {settings['tokens_per_step']} real tokens per step at most; "
        f"{settings['warmup_steps']} warm-up + {settings['steps']} timed steps per mode; "
        f"inductor cache: {settings['inductor_cache']}; run wall time {report['wall_s']:.0f} s; "
        f"1-minute load average during the modes {_load_range(report['results'])}.",
        "",
        _workload_line(report["workload"]),
        "",
        "| family | mode | tokens/s | x padded eager | x padded compiled | x grouped | compile s | graphs / breaks "
        "| compiles | peak MB | max logit diff | padding | error / note |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    lines += [_markdown_row(r) for r in report["results"]]
    lines += ["", "## Bars", "", "| family | bar | value | target | met | detail |", "|---|---|--:|--:|---|---|"]
    lines += [_bar_row(b) for b in report["bars"]]
    lines += _profile_sections(report["results"])
    return "\n".join(lines) + "\n"


def _profile_sections(results: list[dict]) -> list[str]:
    """Top ops (self CPU time) of each profiled mode: where the step's time goes."""
    lines = []
    for r in results:
        if not r.get("profile_top"):
            continue
        lines += ["", f"### Profile: {r['family']} {r['mode']} (one extra step, torch.profiler, self CPU time)", "",
                  "| op | self CPU ms | share | calls |", "|---|--:|--:|--:|"]
        lines += [f"| `{e['op']}` | {e['self_cpu_ms']:.0f} | {e['share']:.0%} | {e['calls']} |" for e in r["profile_top"]]
    return lines


def _load_range(results: list[dict]) -> str:
    loads = [x for r in results for x in (r.get("load_avg") or []) if x is not None]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "unknown"


def _workload_line(workload: dict) -> str:
    return (
        f"Documents: {workload['timed_docs']} in the timed steps, lengths {workload['length_mix']} "
        f"(median {workload['median_len']}, mean {workload['mean_len']:.0f}, max {workload['max_len']}); "
        f"real tokens per timed step {workload['real_tokens_per_step']}; arrival-order padded batches are "
        f"{100 * workload['arrival_padding_frac']:.0f}% padding (padded/real {workload['arrival_padded_over_real']:.2f})."
    )


def _markdown_row(r: dict) -> str:
    ratios = r.get("speedup_vs") or {}
    cells = [
        r["family"],
        r["mode"],
        cell(r.get("tokens_per_s"), "{:.0f}"),
        *(cell(ratios.get(base), "{:.2f}x") for base in RATIO_BASES),
        cell(r.get("compile_s"), "{:.1f}"),
        _graphs(r),
        cell(r.get("compiles"), "{}"),
        cell(r.get("peak_mem_mb"), "{:.0f}"),
        _diff(r),
        cell(r.get("padding_frac"), "{:.0%}"),
        _issue(r),
    ]
    return "| " + " | ".join(cells) + " |"


def _bar_row(bar: dict) -> str:
    met = {True: "met", False: "**missed**", None: "n/a"}[bar["met"]]
    value = cell(bar["value"], "{:.2f}")
    return f"| {bar['family']} | {bar['bar']} | {value} | {bar['target']} | {met} | {bar['detail']} |"


def _graphs(r: dict) -> str:
    return "-" if r.get("graphs") is None else f"{r['graphs']} / {r['graph_breaks']}"


def _diff(r: dict) -> str:
    text = cell(r.get("max_logit_diff"), "{:.1e}")
    leak = r.get("max_logit_diff_position_ids_only")
    return text if leak is None else f"{text} (position_ids only: {leak:.1e})"


def _issue(r: dict) -> str:
    return text_cell(r.get("error") or r.get("note") or "")


# ------------------------------------------------------------------------------------------------ plot


def plot(report: dict, path: pathlib.Path) -> None:
    """Grouped bars: tokens/s per family and mode (log scale); a mode without a figure is marked 'x'."""
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
        xs, ys, missing = [], [], []
        for position, family in enumerate(families):
            by_mode = {r["mode"]: r for r in results if r["family"] == family}
            x = position - 0.4 + width * (index + 0.5)
            value = tokens_per_s(by_mode, mode)
            if value:
                xs.append(x)
                ys.append(value)
            else:
                missing.append(x)
        axes.bar(xs, ys, width, color=colors(index))
        # a missing figure is an 'x' at the foot of the axis (x in data, y in axes coordinates)
        axes.plot(missing, [0.03] * len(missing), "x", color=colors(index), markersize=9, mew=2,
                  transform=axes.get_xaxis_transform())
        handles.append(Patch(color=colors(index), label=mode))
    axes.set_yscale("log")
    axes.set_xticks(range(len(families)), families)
    axes.set_ylabel("real tokens / s (training step, log scale)")
    axes.set_title(f"compilepack bench, {report['device']} ({report['threads']} threads), {report['date']}"
                   "\nx: no figure (error or time limit)")
    axes.legend(handles=handles, fontsize=8, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------ console


def print_console(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"compilepack bench ({report['device']}, {report['date']})", show_lines=False)
    for column in ("family", "mode", "tok/s", "x pad eager", "x pad comp", "x grouped", "compile s",
                   "graphs/brk", "compiles", "peak MB", "max diff", "padding", "error / note"):
        table.add_column(column, overflow="fold")
    for r in report["results"]:
        ratios = r.get("speedup_vs") or {}
        table.add_row(
            r["family"], r["mode"], cell(r.get("tokens_per_s"), "{:.0f}"),
            *(cell(ratios.get(base), "{:.2f}x") for base in RATIO_BASES),
            cell(r.get("compile_s"), "{:.1f}"), _graphs(r), cell(r.get("compiles"), "{}"),
            cell(r.get("peak_mem_mb"), "{:.0f}"), cell(r.get("max_logit_diff"), "{:.1e}"),
            cell(r.get("padding_frac"), "{:.0%}"), _issue(r)[:60],
        )
    console = Console(width=max(Console().width, 180))  # a narrow or piped terminal would fold every cell
    console.print(table)
    for bar in report["bars"]:
        met = {True: "[green]met[/]", False: "[red]missed[/]", None: "[yellow]n/a[/]"}[bar["met"]]
        console.print(f"{bar['family']:>11}  {met}  {bar['bar']}: {cell(bar['value'], '{:.2f}')} "
                      f"(target {bar['target']}) {bar['detail']}")

