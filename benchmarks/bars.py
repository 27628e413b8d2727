"""The bars, checked per family on paired ratios against :data:`TARGETS` (docs/benchmarks.md shows the table and
says the rules: a test checks the two agree). The grouped bars are patched compiled, never patched eager swapped in
for a higher median (its own rounds could miss)."""

from __future__ import annotations

import statistics
from typing import NamedTuple

from compilepack.patching import family_named

from .modes import (PATCHED_PACKED_COMPILED, PATCHED_PACKED_EAGER, STOCK_GROUPED_COMPILED, STOCK_GROUPED_EAGER,
                    STOCK_PACKED, STOCK_PADDED_COMPILED, STOCK_PADDED_EAGER)

ARRIVAL_MODES = (STOCK_PADDED_EAGER, STOCK_PADDED_COMPILED)
PATCHED_PACKED = (PATCHED_PACKED_EAGER, PATCHED_PACKED_COMPILED)
MET, MISSED, NOT_DECIDED, NA = "met", "missed", "not decided", "n/a"
EVERY_ROUND, MEDIAN, ONE_COMPILE = "every round", "median", "one compile"


class Target(NamedTuple):
    value: float
    shown: str  # as the docs table shows it
    rule: str  # as the docs table says it
    compares: str


# The bars' targets, read by the report and shown by docs/benchmarks.md ("no slower" is 0.95x: a 5% allowance
# for the run-to-run noise of a 2-core step).
TARGETS = {
    "arrival": Target(5.0, "5x", EVERY_ROUND, "patched packed (the better of eager and compiled by median) vs the "
                      "faster arrival-order stock padded mode"),
    "grouped_attention_only": Target(0.95, "0.95x", MEDIAN, "attention-only families (e.g. Llama): patched compiled "
                                     "no slower than stock grouped eager"),
    "grouped_compiled": Target(1.15, "1.15x", EVERY_ROUND, "attention-only families: patched compiled vs stock "
                               "compiled grouped"),
    "grouped": Target(1.15, "1.15x", EVERY_ROUND, "hybrid families (e.g. Qwen3-Next, Qwen3.5, Bamba): patched "
                      "compiled vs stock grouped eager"),
    "stock_packed": Target(3.0, "3x", EVERY_ROUND, "patched packed vs stock packed, where it runs (Llama's dense "
                           "mask)"),
    "compiled_vs_eager": Target(0.95, "0.95x", EVERY_ROUND, "patched compiled vs patched eager (no slower, 5% noise "
                                "allowance)"),
    "compile_time": Target(1.0, "<= 1x", "one compile each", "patched compile time vs stock compiled's (CPU "
                           "seconds where both have them)"),
}


def targets_table() -> str:
    """:data:`TARGETS` as the markdown table docs/benchmarks.md holds."""
    rows = [f"| `{key}` | {t.compares} | {t.shown} | {t.rule} |" for key, t in TARGETS.items()]
    return "\n".join(["| key | bar | target | rule |", "| --- | --- | --: | --- |", *rows])


def evaluate(results: list[dict]) -> list[dict]:
    """One entry per (family, bar): value (median), min, max, target, status, met, detail."""
    return [bar for family in dict.fromkeys(r["family"] for r in results)
            for bar in _family_bars(family, {r["mode"]: r for r in results if r["family"] == family})]


def tokens_per_s(by_mode: dict, mode: str) -> float | None:
    """The mode's median tokens/s, None without one (not run, failed before a round, no round measured)."""
    return (by_mode.get(mode) or {}).get("tokens_per_s") or None


def round_tokens_per_s(result: dict) -> dict[int, float]:
    """round -> tokens/s of the rounds the mode's median is taken over (those that did not compile, or all)."""
    rounds = [r for r in result.get("rounds") or [] if r.get("tokens_per_s")]
    steady = [r for r in rounds if not r.get("compiled")] or rounds
    return {r["round"]: r["tokens_per_s"] for r in steady}


def paired_ratios(numerator: dict, denominator: dict) -> list[float]:
    """tokens/s of ``numerator`` over ``denominator``'s, round by round, over the rounds both measured."""
    a, b = round_tokens_per_s(numerator), round_tokens_per_s(denominator)
    return [a[r] / b[r] for r in sorted(a.keys() & b.keys())]


def status(low: float, high: float, target: float, higher_is_better: bool = True) -> str:
    """met when the whole range is on the right side of the target, missed when it is all on the wrong side."""
    if not higher_is_better:
        low, high, target = -high, -low, -target
    if low >= target:
        return MET
    if high < target:
        return MISSED
    return NOT_DECIDED


def best_of(by_mode: dict, modes) -> str | None:
    """The one of ``modes`` with the higher median tokens/s, None if none has one."""
    return max(((tokens_per_s(by_mode, m), m) for m in modes if tokens_per_s(by_mode, m)), default=(None, None))[1]


def attention_only(family: str) -> bool:
    """Whether every layer of the family's model is attention alone (``Family.stock_packs_positions``): its grouped
    bar is "no slower" on the median, not a speedup in every round."""
    return family_named(family).stock_packs_positions


def _family_bars(family: str, by_mode: dict) -> list[dict]:
    patched = best_of(by_mode, PATCHED_PACKED) or PATCHED_PACKED
    arrival = best_of(by_mode, ARRIVAL_MODES) or ARRIVAL_MODES
    goal = {key: target.value for key, target in TARGETS.items()}
    bars = [_ratio_bar(family, f"patched packed >= {goal['arrival']:g}x faster arrival-order stock padded", by_mode,
                       patched, arrival, goal["arrival"]),
            _grouped_bar(family, by_mode)]
    if STOCK_GROUPED_COMPILED in by_mode:  # compiled against compiled, where the run has stock compiled grouped
        bars.append(_ratio_bar(family, f"patched compiled >= {goal['grouped_compiled']:g}x stock compiled grouped",
                               by_mode, PATCHED_PACKED_COMPILED, STOCK_GROUPED_COMPILED, goal["grouped_compiled"]))
    if tokens_per_s(by_mode, STOCK_PACKED):
        bars.append(_ratio_bar(family, f"patched packed >= {goal['stock_packed']:g}x stock packed (dense mask)",
                               by_mode, patched, STOCK_PACKED, goal["stock_packed"]))
    bars.append(_ratio_bar(family, "patched compiled no slower than patched eager", by_mode, PATCHED_PACKED_COMPILED,
                           PATCHED_PACKED_EAGER, goal["compiled_vs_eager"],
                           note=f" ({1 - goal['compiled_vs_eager']:.0%} noise allowance)"))
    bars.append(_compile_bar(family, by_mode, goal["compile_time"]))
    return bars


def _grouped_bar(family: str, by_mode: dict) -> dict:
    """Patched compiled against stock grouped eager, whenever the run has the compiled mode (failed or not);
    patched eager only in a run without it (``--modes`` subsets), named so in the bar. Attention-only families:
    no slower, on the median; the others: the ``grouped`` target in every round (see the module's docstring)."""
    mode = next((m for m in (PATCHED_PACKED_COMPILED, PATCHED_PACKED_EAGER) if m in by_mode), PATCHED_PACKED)
    kind = {PATCHED_PACKED_COMPILED: "compiled", PATCHED_PACKED_EAGER: "eager"}.get(mode, "packed")
    if attention_only(family):
        goal = TARGETS["grouped_attention_only"].value
        return _ratio_bar(family, f"patched {kind} no slower than stock grouped by length", by_mode, mode,
                          STOCK_GROUPED_EAGER, goal, note=f" (median, {1 - goal:.0%} noise allowance)", rule=MEDIAN)
    goal = TARGETS["grouped"].value
    return _ratio_bar(family, f"patched {kind} >= {goal:g}x stock grouped by length", by_mode, mode,
                      STOCK_GROUPED_EAGER, goal)


def _entry(family, bar, target, detail, value=None, low=None, high=None, state=NA, ratios=None,
           rule=EVERY_ROUND) -> dict:
    return {"family": family, "bar": bar, "value": value, "min": low, "max": high, "target": target,
            "status": state, "met": {MET: True, MISSED: False}.get(state), "rule": rule, "ratios": ratios or [],
            "rounds": len(ratios or []), "detail": detail}


def _ratio_bar(family, bar, by_mode, numerator, denominator, target, note="", rule=EVERY_ROUND) -> dict:
    """``numerator``/``denominator``: a mode name, or the candidates (a tuple) when none of them has a figure.
    ``rule``: ``EVERY_ROUND`` decides on the range of the paired ratios, ``MEDIAN`` on their median."""
    names = [" or ".join(m) if isinstance(m, tuple) else m for m in (numerator, denominator)]
    detail = f"{names[0]} vs {names[1]}{note}"
    missing = [_why_missing(by_mode, m) for m in (numerator, denominator) if isinstance(m, tuple)
               or not tokens_per_s(by_mode, m)]
    if missing:
        return _entry(family, bar, target, detail + ": " + "; ".join(missing), rule=rule)
    ratios = paired_ratios(by_mode[numerator], by_mode[denominator])
    if not ratios:
        return _entry(family, bar, target, detail + ": no round measured by both", rule=rule)
    low, high, median = min(ratios), max(ratios), statistics.median(ratios)
    detail += f", {len(ratios)} paired round{'s' * (len(ratios) != 1)}"
    state = status(median, median, target) if rule == MEDIAN else status(low, high, target)
    return _entry(family, bar, target, detail, round(median, 2), round(low, 2), round(high, 2), state,
                  [round(r, 3) for r in ratios], rule)


def _why_missing(by_mode: dict, modes) -> str:
    return ", ".join(f"{mode} not run" if mode not in by_mode else
                     f"{mode} has no figure ({(by_mode[mode].get('error') or 'no round measured')[:160]})"
                     for mode in (modes if isinstance(modes, tuple) else (modes,)))


def _compile_bar(family: str, by_mode: dict, target: float) -> dict:
    bar = "patched compile time <= stock compile time"
    # stock's compile: the padded mode's, or the grouped mode's where the padded one was not run (the default)
    stock_mode = STOCK_PADDED_COMPILED if STOCK_PADDED_COMPILED in by_mode or STOCK_GROUPED_COMPILED not in by_mode \
        else STOCK_GROUPED_COMPILED
    patched, stock = by_mode.get(PATCHED_PACKED_COMPILED), by_mode.get(stock_mode)
    # CPU seconds where both have them: compiles taken side by side share the cores, which stretches their wall
    # times by however much they overlapped, but not the CPU each one used
    key = "compile_cpu_s" if all(r and r.get("compile_cpu_s") is not None for r in (patched, stock)) else "compile_s"
    detail = f"{PATCHED_PACKED_COMPILED} vs {stock_mode} {key}"
    if not patched or patched.get("compile_s") is None or not stock:
        missing = [m for m, r in ((PATCHED_PACKED_COMPILED, patched), (stock_mode, stock)) if not r]
        why = f"{', '.join(missing)} not run" if missing else f"{PATCHED_PACKED_COMPILED} has no compile time"
        return _entry(family, bar, target, f"{detail}: {why}", rule=ONE_COMPILE)
    stock_compile = stock.get(key)
    error = stock.get("error") or ""
    if stock_compile is None and error.startswith("TimeoutError") and "compile" in error:
        # the stock compile never finished: it took at least the mode's time limit
        limit = stock.get("timeout_s") or 0
        return _entry(family, bar, target, f"{detail}: stock did not finish compiling within {limit} s",
                      state=MET if patched["compile_s"] <= limit else NOT_DECIDED, rule=ONE_COMPILE)
    if stock_compile is None:
        return _entry(family, bar, target, f"{detail}: stock compiled has no compile time ({error or 'not measured'})",
                      rule=ONE_COMPILE)
    value = round(patched[key] / max(stock_compile, 1e-9), 2)
    return _entry(family, bar, target, detail + " (one cold compile each)", value, value, value,
                  status(value, value, target, higher_is_better=False), rule=ONE_COMPILE)

