"""The round-robin driver: one warm worker per mode of a family, timed steps taken in rounds.

A family's workers are started together (``concurrent``: their warm-ups, mostly single-threaded compiles and
short eager steps, share the machine) or one after another, and each gets ready on its own: model, logits-alone
check, patch, compile, warm-up. Then round ``r`` asks every ready worker, one at a time, for its timed round
``r``, in the family's mode order rotated by ``r`` (round 0 starts with the first mode, round 1 with the second,
...). While one worker runs its round the others wait on their pipes, doing nothing. A load change on the
machine therefore hits every mode of a round alike, and the ratio of two modes' tokens/s in the same round (the
bars' paired ratios) cancels it. Only one family's workers are alive at a time, which bounds memory.
"""

from __future__ import annotations

from typing import Protocol


class Worker(Protocol):
    spec: object
    result: dict

    def start(self) -> None: ...

    def await_ready(self, timeout_s: float) -> bool: ...

    def run_round(self, index: int, position: int, timeout_s: float) -> bool: ...

    def finish(self, timeout_s: float) -> dict: ...

    def stop(self) -> None: ...


def round_order(modes: list[str], index: int) -> list[str]:
    """The modes of round ``index``: the planned order rotated by ``index``."""
    if not modes:
        return []
    shift = index % len(modes)
    return list(modes[shift:]) + list(modes[:shift])


def run_family(workers: dict[str, Worker], rounds: int, warmup_timeout_s: float, step_timeout_s: float,
               concurrent: bool = True, on_done=lambda mode, what: None, one_at_a_time: bool = False) -> list[dict]:
    """Every worker's result, in the order of ``workers`` (mode -> worker, the planned order). ``on_done(mode,
    what)`` is told when a worker got ready or failed to (``what`` "ready"/"ended") and after each round it ran
    ("round"). ``one_at_a_time``: each worker gets ready, runs all its rounds and finishes before the next one
    starts, so only one model is held at a time (real widths); round r still has the same documents in every mode,
    but the modes' rounds no longer run side by side, so a load change is not cancelled by the pairing."""
    if one_at_a_time:
        return [_run_alone(mode, w, rounds, warmup_timeout_s, step_timeout_s, on_done) for mode, w in workers.items()]
    ready = {}
    try:
        if concurrent:
            for w in workers.values():
                w.start()
        for mode, w in workers.items():
            if not concurrent:
                w.start()
            ready[mode] = w.await_ready(warmup_timeout_s)
            on_done(mode, "ready" if ready[mode] else "ended")
        for index in range(rounds):
            running = [mode for mode in round_order(list(workers), index) if ready[mode]]
            for position, mode in enumerate(running):
                ready[mode] = workers[mode].run_round(index, position, step_timeout_s)
                on_done(mode, "round" if ready[mode] else "ended")
        return [w.finish(step_timeout_s) for w in workers.values()]
    finally:
        for w in workers.values():
            w.stop()


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
