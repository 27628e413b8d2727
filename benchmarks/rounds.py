"""The round-robin driver: one warm worker per mode of a family, timed steps taken in rounds.

A family's workers are started together (``concurrent``: their warm-ups, mostly single-threaded compiles and
short eager steps, share the machine) or one after another, and each gets ready on its own: model, logits-alone
check, patch, compile, warm-up. Then round ``r`` asks every ready worker, one at a time, for its timed round
``r``, in the family's mode order rotated by ``r`` (round 0 starts with the first mode, round 1 with the second,
...), one step at a time: a round of several steps (the grouped mode's long, middle and short batch; the patched
modes' arrival step, repeated as often) is interleaved step by step with the other modes' rounds, so the steps
that a paired ratio compares lie next to each other in time. While one worker runs its step the others wait on
their pipes, doing nothing. A load change on the machine therefore hits every mode of a round alike, and the ratio
of two modes' tokens/s in the same round (the bars' paired ratios) cancels it. Only one family's eager workers are alive
at a time, which bounds memory (a padded hybrid step holds ~6 GB; a warm compiled worker ~1 GB).

With ``--warmup compiles-first`` (the default run) the compiled modes of every family get ready first, before any
family's rounds, ``warm_up_in_lanes``: as many compiles at a time as the machine has cores (a cold compile keeps
about one core busy: dynamo, AOT autograd and inductor are single-threaded Python, only g++ runs beside them), so
the 2-core machine compiles two models at once instead of one family's compile beside a few short eager steps.
A compiled worker then waits, idle, until its family's turn; a family's eager modes warm up when it comes, and
the rounds run only once no compile is left anywhere, so nothing competes with a timed step.

Why step by step: a whole round of one mode, then a whole round of the next, leaves the machine time to change
between the two sides of a ratio. On the Qwen3.5 bench model (patched compiled / stock grouped eager, 10 rounds of
three steps each, one process) three grouped steps then three patched ones gave ratios 1.10-1.29 (standard
deviation 0.061); the same steps alternating gave 1.19-1.29 (0.034).
"""

from __future__ import annotations

from typing import Protocol


class Worker(Protocol):
    spec: object
    result: dict

    def start(self) -> None: ...

    def await_ready(self, timeout_s: float) -> bool: ...

    def run_round(self, index: int, position: int, timeout_s: float, part: int | None = None) -> bool: ...

    def finish(self, timeout_s: float) -> dict: ...

    def stop(self) -> None: ...


def round_order(modes: list[str], index: int) -> list[str]:
    """The modes of round ``index``: the planned order rotated by ``index``."""
    if not modes:
        return []
    shift = index % len(modes)
    return list(modes[shift:]) + list(modes[:shift])


def warm_up_in_lanes(workers: dict, lanes: int, warmup_timeout_s: float, on_done=lambda key, what: None) -> dict:
    """Start ``workers`` (key -> worker) in their order, at most ``lanes`` getting ready at a time, and wait for
    each: key -> whether it got ready (``on_done(key, "ready"/"ended")`` as each is known). A worker's time limit
    runs from its own start, as in :func:`run_family`. The next worker starts when the earliest started one is
    ready, so a lane can idle while a later-started compile finishes first; every worker is stopped if this is
    interrupted."""
    ready, waiting, queue = {}, [], list(workers.items())
    try:
        while queue or waiting:
            while queue and len(waiting) < max(1, lanes):
                key, worker = queue.pop(0)
                worker.start()
                waiting.append((key, worker))
            key, worker = waiting.pop(0)
            ready[key] = worker.await_ready(warmup_timeout_s)
            on_done(key, "ready" if ready[key] else "ended")
    except BaseException:
        for worker in workers.values():
            worker.stop()
        raise
    return ready


def run_family(workers: dict[str, Worker], rounds: int, warmup_timeout_s: float, step_timeout_s: float,
               concurrent: bool = True, on_done=lambda mode, what: None, one_at_a_time: bool = False,
               warm: dict[str, bool] | None = None) -> list[dict]:
    """Every worker's result, in the order of ``workers`` (mode -> worker, the planned order). ``on_done(mode,
    what)`` is told when a worker got ready or failed to (``what`` "ready"/"ended") and after each round it ran
    ("round"). ``warm``: modes already started and waited for (:func:`warm_up_in_lanes`) -> whether they got
    ready; they are not started again. ``one_at_a_time``: each worker gets ready, runs all its rounds and
    finishes before the next one starts, so only one model is held at a time (real widths); round r still has the
    same documents in every mode, but the modes' rounds no longer run side by side, so a load change is not
    cancelled by the pairing."""
    if one_at_a_time:
        return [_run_alone(mode, w, rounds, warmup_timeout_s, step_timeout_s, on_done) for mode, w in workers.items()]
    ready = dict(warm or {})
    cold = {mode: w for mode, w in workers.items() if mode not in ready}
    try:
        # concurrent: every cold worker started before any is waited for; serial: one lane
        ready |= warm_up_in_lanes(cold, len(cold) if concurrent else 1, warmup_timeout_s, on_done)
        for index in range(rounds):
            _run_round_interleaved(workers, ready, index, step_timeout_s, on_done)
        return [w.finish(step_timeout_s) for w in workers.values()]
    finally:
        for w in workers.values():
            w.stop()


def _run_round_interleaved(workers: dict[str, Worker], ready: dict[str, bool], index: int, step_timeout_s: float,
                           on_done) -> None:
    """Round ``index`` of every ready worker, step by step: step 0 of each in the round's order, then step 1 of
    those that have one, ... A worker's position is its place in the round's order, the same for all its steps."""
    running = [mode for mode in round_order(list(workers), index) if ready[mode]]
    steps = {mode: round_steps(workers[mode], index) for mode in running}
    for part in range(max(steps.values(), default=0)):
        for position, mode in enumerate(running):
            if not ready[mode] or part >= steps[mode]:
                continue
            ready[mode] = workers[mode].run_round(index, position, step_timeout_s, part=part)
            if not ready[mode] or part == steps[mode] - 1:
                on_done(mode, "round" if ready[mode] else "ended")


def round_steps(worker: Worker, index: int) -> int:
    """How many steps the worker's round ``index`` has (what it reported when ready; 1 if it did not say)."""
    steps = worker.result.get("round_steps")
    return steps[index] if steps and index < len(steps) else 1


def _run_alone(mode: str, worker: Worker, rounds: int, warmup_timeout_s: float, step_timeout_s: float,
               on_done) -> dict:
    try:
        worker.start()
        ok = worker.await_ready(warmup_timeout_s)
        on_done(mode, "ready" if ok else "ended")
        for index in range(rounds):
            if not ok:
                break
            ok = worker.run_round(index, 0, step_timeout_s)
            on_done(mode, "round" if ok else "ended")
        return worker.finish(step_timeout_s)
    finally:
        worker.stop()
