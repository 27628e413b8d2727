"""The bars, checked per family against one run's results, on paired ratios. Their targets are the table
"The bars" in docs/benchmarks.md, read at run time (:func:`targets`); this module says which modes each compares
and by which rule:

- ``arrival``: patched packed (best of eager/compiled) against the faster arrival-order stock padded mode;
- against stock padded batches grouped by length (the strongest stock option), by what the family mixes
  (:func:`attention_only`: a property of the family's declaration, not its name): attention-only families
  (``Family.stock_packs_positions``; e.g. Llama) take ``grouped_attention_only`` ("no slower" than stock grouped
  eager, on the median: a single 2-core round moves by ±10%, and such a model's grouped batches pad ~3%, so the
  ceiling is near parity) and ``grouped_compiled`` (patched compiled against stock compiled grouped, every round);
  hybrids (a linear mixer beside attention; e.g. Qwen3-Next, Qwen3.5, Bamba) take ``grouped`` in every round;
  both name patched eager instead where the run has no compiled mode;
- ``stock_packed``, where stock packed runs (Llama's dense mask);
- ``compiled_vs_eager`` (patched compiled no slower than patched eager) and ``compile_time`` (its compile no longer
  than stock's).

A speed bar compares two modes round by round: the modes ran their timed round ``r`` one right after the other
(see ``rounds``), so ``ratio_r`` = tokens/s of mode A in round r / tokens/s of mode B in round r sees the same
machine load on both sides. The bar's ``value`` is the median of the paired ratios, ``min`` and ``max`` their
range, and its ``status``, for a bar decided in every round (``rule`` "every round"): "met" only if even the
smallest ratio reaches the target, "missed" only if even the largest falls short, "not decided" when the rounds
straddle the target; for a bar decided on the median (``rule`` "median"): "met" or "missed" by the median alone;
"n/a" when a figure is missing. ``met`` is True / False / None (not decided or n/a). "Patched packed" is whichever
of patched eager and patched compiled has the higher median tokens/s; the paired ratios are that mode's. The
grouped bars are the issue's "patched compiled" and never swap in the eager mode for its higher median: a mode
chosen by its median can read "met" while the compiled mode's own rounds miss.
"""

from __future__ import annotations

import functools
import pathlib
import re
import statistics

from .modes import (
    PATCHED_PACKED_COMPILED,
    PATCHED_PACKED_EAGER,
    STOCK_GROUPED_COMPILED,
    STOCK_GROUPED_EAGER,
    STOCK_PACKED,
    STOCK_PADDED_COMPILED,
    STOCK_PADDED_EAGER,
)

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
BAR_KEYS = ("arrival", "grouped_attention_only", "grouped_compiled", "grouped", "stock_packed", "compiled_vs_eager",
            "compile_time")

ARRIVAL_MODES = (STOCK_PADDED_EAGER, STOCK_PADDED_COMPILED)
PATCHED_PACKED = (PATCHED_PACKED_EAGER, PATCHED_PACKED_COMPILED)
MET, MISSED, NOT_DECIDED, NA = "met", "missed", "not decided", "n/a"
EVERY_ROUND, MEDIAN, ONE_COMPILE = "every round", "median", "one compile"


@functools.cache
def targets(path: pathlib.Path = DOCS) -> dict[str, float]:
    """key -> target, from the table of docs/benchmarks.md whose header is ``| key | bar | target | rule |``: the
    rows' target cells (``5x``, ``0.95x``, ``<= 1x``) as numbers."""
    lines = path.read_text().splitlines()
    header = next((i for i, line in enumerate(lines) if re.fullmatch(r"\| key \| bar \| target \| rule \|", line)), None)
    found = {}
    for line in lines[header + 2:] if header is not None else []:
        if not line.startswith("|"):
            break
        key, _, target, _ = (cell.strip() for cell in line.strip("|").split("|"))
        found[key.strip("`")] = float(re.search(r"\d+(\.\d+)?", target).group())
    missing = [key for key in BAR_KEYS if key not in found]
    if missing:
        raise SystemExit(f"{path}: the bars table (header '| key | bar | target | rule |') has no row for "
                         f"{', '.join(missing)}; each bar's target is read from it")
    return found


def evaluate(results: list[dict]) -> list[dict]:
    """One entry per (family, bar): value (median), min, max, target, status, met, detail."""
    bars = []
    for family in dict.fromkeys(r["family"] for r in results):
        by_mode = {r["mode"]: r for r in results if r["family"] == family}
        bars += _family_bars(family, by_mode)
    return bars


def tokens_per_s(by_mode: dict, mode: str) -> float | None:
    """The mode's median tokens/s, None without one (not run, failed before a round, no round measured). A mode
    stopped after some rounds keeps the rounds it measured."""
    result = by_mode.get(mode)
    if result is None or not result.get("tokens_per_s"):
        return None
    return result["tokens_per_s"]


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


def best_of(by_mode: dict, modes) -> tuple[str | None, float | None]:
    candidates = [(tokens_per_s(by_mode, m), m) for m in modes if tokens_per_s(by_mode, m)]
    if not candidates:
        return None, None
    value, mode = max(candidates)
    return mode, value


def attention_only(family: str) -> bool:
    """Whether every layer of the family's model is attention alone (``Family.stock_packs_positions``, declared by
    the family's layers): its grouped bar is "no slower" on the median, not a speedup in every round."""
    from compilepack.patching import family_named

    return family_named(family).stock_packs_positions


def _family_bars(family: str, by_mode: dict) -> list[dict]:
    target = targets()
    patched, _ = best_of(by_mode, PATCHED_PACKED)
    arrival, _ = best_of(by_mode, ARRIVAL_MODES)
    bars = [
        _ratio_bar(family, f"patched packed >= {target['arrival']:g}x faster arrival-order stock padded", by_mode,
                   patched or PATCHED_PACKED, arrival or ARRIVAL_MODES, target["arrival"]),
        _grouped_bar(family, by_mode),
    ]
    if STOCK_GROUPED_COMPILED in by_mode:  # compiled against compiled, where the run has stock compiled grouped
        bars.append(_ratio_bar(family, f"patched compiled >= {target['grouped_compiled']:g}x stock compiled grouped",
                               by_mode, PATCHED_PACKED_COMPILED, STOCK_GROUPED_COMPILED, target["grouped_compiled"]))
    if tokens_per_s(by_mode, STOCK_PACKED):
        bars.append(_ratio_bar(family, f"patched packed >= {target['stock_packed']:g}x stock packed (dense mask)",
                               by_mode, patched or PATCHED_PACKED, STOCK_PACKED, target["stock_packed"]))
    bars.append(_ratio_bar(family, "patched compiled no slower than patched eager", by_mode,
                           PATCHED_PACKED_COMPILED, PATCHED_PACKED_EAGER, target["compiled_vs_eager"],
                           note=f" ({1 - target['compiled_vs_eager']:.0%} noise allowance)"))
    bars.append(_compile_bar(family, by_mode, target["compile_time"]))
    return bars


def _grouped_bar(family: str, by_mode: dict) -> dict:
    """Patched compiled against stock grouped eager, whenever the run has the compiled mode (failed or not);
    patched eager only in a run without it (``--modes`` subsets), named so in the bar. Attention-only families:
    no slower, on the median; the others: the ``grouped`` target in every round (see the module's docstring)."""
    mode = next((m for m in (PATCHED_PACKED_COMPILED, PATCHED_PACKED_EAGER) if m in by_mode), PATCHED_PACKED)
    kind = {PATCHED_PACKED_COMPILED: "compiled", PATCHED_PACKED_EAGER: "eager"}.get(mode, "packed")
    if attention_only(family):
        target = targets()["grouped_attention_only"]
        return _ratio_bar(family, f"patched {kind} no slower than stock grouped by length", by_mode, mode,
                          STOCK_GROUPED_EAGER, target, note=f" (median, {1 - target:.0%} noise allowance)",
                          rule=MEDIAN)
    target = targets()["grouped"]
    return _ratio_bar(family, f"patched {kind} >= {target:g}x stock grouped by length", by_mode, mode,
                      STOCK_GROUPED_EAGER, target)


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
    modes = modes if isinstance(modes, tuple) else (modes,)
    reasons = []
    for mode in modes:
        result = by_mode.get(mode)
        if result is None:
            reasons.append(f"{mode} not run")
        else:
            reasons.append(f"{mode} has no figure ({(result.get('error') or 'no round measured')[:160]})")
    return ", ".join(reasons)


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
    if stock_compile is None and _compile_timed_out(stock):
        # the stock compile never finished: it took at least the mode's time limit
        limit = stock.get("timeout_s") or 0
        return _entry(family, bar, target, f"{detail}: stock did not finish compiling within {limit} s",
                      state=MET if patched["compile_s"] <= limit else NOT_DECIDED, rule=ONE_COMPILE)
    if stock_compile is None:
        return _entry(family, bar, target,
                      f"{detail}: stock compiled has no compile time ({stock.get('error') or 'not measured'})",
                      rule=ONE_COMPILE)
    value = round(patched[key] / max(stock_compile, 1e-9), 2)
    return _entry(family, bar, target, detail + " (one cold compile each)", value, value, value,
                  status(value, value, target, higher_is_better=False), rule=ONE_COMPILE)


def _compile_timed_out(result: dict) -> bool:
    error = result.get("error") or ""
    return error.startswith("TimeoutError") and "compile" in error
