"""The round-robin driver: one warm worker per mode of a family, timed steps taken in rounds, each round's steps
side by side in time (docs/benchmarks.md, "How"). One family's eager workers are alive at a time, which bounds
memory (a padded hybrid step holds ~6 GB)."""

from __future__ import annotations


def round_order(modes: list[str], index: int) -> list[str]:
    """The modes of round ``index``: the planned order rotated by ``index``."""
    shift = index % len(modes) if modes else 0
    return list(modes[shift:]) + list(modes[:shift])


def warm_up_in_lanes(workers: dict, lanes: int, warmup_timeout_s: float, on_done=lambda key, what: None) -> dict:
    """Start ``workers`` (key -> worker) in their order, at most ``lanes`` getting ready at a time, and wait for
    each (its time limit runs from its own start): key -> whether it got ready (``on_done(key, "ready"/"ended")``
    as each is known). The next worker starts when the earliest started one is ready; every worker is stopped if
    this is interrupted."""
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


def run_family(workers: dict, rounds: int, warmup_timeout_s: float, step_timeout_s: float,
               on_done=lambda mode, what: None, warm: dict[str, bool] | None = None) -> list[dict]:
    """Every worker's result, in the order of ``workers`` (mode -> worker, the planned order). ``warm``: modes
    already started and waited for (mode -> whether they got ready); the others warm up together first.
    ``on_done(mode, what)``: a worker got ready or failed to ("ready"/"ended"), or ran a round ("round")."""
    ready = dict(warm or {})
    cold = {mode: w for mode, w in workers.items() if mode not in ready}
    try:
        ready |= warm_up_in_lanes(cold, len(cold), warmup_timeout_s, on_done)
        for index in range(rounds):
            _run_round_interleaved(workers, ready, index, step_timeout_s, on_done)
        return [w.finish(step_timeout_s) for w in workers.values()]
    finally:
        for w in workers.values():
            w.stop()


def _run_round_interleaved(workers: dict, ready: dict[str, bool], index: int, step_timeout_s: float,
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


def round_steps(worker, index: int) -> int:
    """How many steps the worker's round ``index`` has (what it reported when ready; 1 if it did not say)."""
    steps = worker.result.get("round_steps")
    return steps[index] if steps and index < len(steps) else 1
