"""Run each mode in a child process with a time limit.

Children are forked from a forkserver that has already imported torch, transformers and compilepack, so a
mode starts in a fraction of a second with empty dynamo state. A mode that runs past its limit (a stock
compile that never ends) is stopped with its compile workers, and reported with what it measured so far.
"""

from __future__ import annotations

import multiprocessing
import pathlib
import time

from . import worker

PRELOAD = ["torch", "transformers", "compilepack", "compilepack.bench.worker"]


class ModeRunner:
    """Runs :class:`~compilepack.bench.worker.ModeSpec` s one at a time, each in a fresh child process."""

    def __init__(self):
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)

    def run(self, spec: worker.ModeSpec, timeout_s: float, on_phase=lambda phase: None) -> dict:
        receiver, sender = self._context.Pipe(duplex=False)
        process = self._context.Process(target=worker.run_in_child, args=(spec, sender), daemon=True)
        started = time.monotonic()
        process.start()
        sender.close()
        phase, figures, result = "starting", worker.empty_result(spec), None
        while result is None:
            remaining = started + timeout_s - time.monotonic()
            if remaining <= 0:
                _stop(process)
                result = _stopped(figures, f"TimeoutError: did not finish within {timeout_s:.0f} s (during {phase})")
            elif receiver.poll(min(remaining, 0.5)):
                try:
                    message = receiver.recv()
                except EOFError:  # the child died without a result (killed, out of memory, segfault)
                    process.join(5)
                    result = _stopped(figures, f"the mode's process died (exit code {process.exitcode}) during {phase}"
                                      + _log_tail(spec.log_path))
                    continue
                if message[0] == "progress":
                    phase, figures = message[1], message[2]
                    on_phase(phase)
                else:
                    result = message[1]
        process.join(10)
        _stop(process)
        result["mode_wall_s"] = round(time.monotonic() - started, 1)
        return result


def _stopped(figures: dict, error: str) -> dict:
    result = dict(figures)
    result["error"] = error
    return result


def _stop(process) -> None:
    """Stop the child and the compile workers it started (and only those)."""
    if process.pid is None or process.exitcode is not None:
        return
    try:
        import psutil

        descendants = psutil.Process(process.pid).children(recursive=True)
    except Exception:  # already gone
        descendants = []
    process.kill()
    for child in descendants:
        try:
            child.kill()
        except Exception:
            pass
    process.join(10)


def _log_tail(path: str | None, lines: int = 3) -> str:
    if not path or not pathlib.Path(path).exists():
        return ""
    tail = [line for line in pathlib.Path(path).read_text(errors="replace").splitlines() if line.strip()][-lines:]
    return ": " + " | ".join(tail)
