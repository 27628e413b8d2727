"""The workers the round-robin driver (``rounds``) commands: one process per mode, forked from a forkserver that
has already imported torch, transformers, compilepack and the families' modeling modules. A worker past its time
limit is stopped with its compile workers and reported as a ``TimeoutError``; one that dies, with its exit code and
the end of its log."""

from __future__ import annotations

import contextlib
import multiprocessing
import pathlib
import time

from . import worker

PRELOAD = ["torch", "transformers", "compilepack", "benchmarks.worker"]


class ProcessContext:
    """The forkserver every worker of a run is forked from (one per run: it keeps its imports warm)."""

    def __init__(self, preload: list[str] = ()):
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD + list(preload))  # a module that fails to import is skipped

    def worker(self, spec: worker.ModeSpec, on_phase=lambda phase: None) -> ProcessWorker:
        return ProcessWorker(self.context, spec, on_phase)


class ProcessWorker:
    """One mode's worker process: ``start()``, ``await_ready``, ``run_round`` per round, ``finish``. Each call
    that waits returns False (or the result) once the mode has ended (failed, died or stopped at its limit)."""

    def __init__(self, context, spec: worker.ModeSpec, on_phase=lambda phase: None):
        self.spec = spec
        self.result = worker.empty_result(spec)
        self.phase = "not started"
        self._context = context
        self._on_phase = on_phase
        self._process = self._receiver = None
        self._ended = self._sent_result = False

    def start(self) -> None:
        self._receiver, sender = self._context.Pipe(duplex=True)
        self._process = self._context.Process(target=worker.serve, args=(self.spec, sender), daemon=True)
        self._started = time.monotonic()
        self.phase = "starting"
        self._process.start()
        sender.close()

    def await_ready(self, timeout_s: float) -> bool:
        """Wait until the worker has built, checked, compiled and warmed up (``timeout_s`` from ``start``)."""
        ok = self._await("ready", self._started + timeout_s, timeout_s, "getting ready")
        self.result["warmup_wall_s"] = self.result.get("warmup_wall_s") or round(time.monotonic() - self._started, 1)
        return ok

    def run_round(self, index: int, position: int, timeout_s: float, part: int | None = None) -> bool:
        """Timed round ``index`` (its step ``part`` only, when given) at ``position`` in the round's order."""
        if not self._send(("round", index, position, part)):
            return False
        self.phase = f"round {index + 1}"  # until the worker says more
        return self._await("round", time.monotonic() + timeout_s, timeout_s, f"round {index + 1}")

    def finish(self, timeout_s: float) -> dict:
        if self._send(("finish",)):
            self._await("result", time.monotonic() + timeout_s, timeout_s, "finishing")
        self.stop()
        return self.result

    def stop(self) -> None:
        """Let a worker that sent its result exit (up to 10 s), then stop whatever is left of it."""
        self._ended = True
        if self._process is not None and self._process.pid is not None:
            self._process.join(10 if self._sent_result else 0)
            _stop(self._process)

    def _send(self, command: tuple) -> bool:
        if self._ended:
            return False
        try:
            self._receiver.send(command)
            return True
        except OSError:  # the worker is gone
            self._died()
            return False

    def _await(self, kind: str, deadline: float, limit_s: float, doing: str) -> bool:
        """Read messages until one of ``kind`` (True) or the mode's end (False)."""
        while True:
            remaining = deadline - time.monotonic()
            if self._receiver.poll(max(0.0, min(remaining, 0.5))):
                try:
                    message = self._receiver.recv()
                except (EOFError, OSError):  # the worker died without a result (killed, out of memory, segfault)
                    self._died()
                    return False
                if message[0] == "progress":
                    self.phase, self.result = message[1], message[2]
                    self._on_phase(self.phase)
                    continue
                self.result = message[1]
                if message[0] == "result":
                    self._sent_result = True
                    self.stop()
                    return kind == "result"
                if message[0] == kind:
                    return True
            elif remaining <= 0:
                self._end(f"TimeoutError: did not finish {doing} within {limit_s:.0f} s (during {self.phase})")
                return False

    def _died(self) -> None:
        self._process.join(5)
        self._end(f"the mode's process died (exit code {self._process.exitcode}) during {self.phase}"
                  + _log_tail(self.spec.log_path))

    def _end(self, error: str) -> None:
        self.stop()
        self.result = dict(self.result, error=error)


def _stop(process) -> None:
    """Stop the worker and the compile workers it started (and only those)."""
    import psutil

    if process.pid is None or process.exitcode is not None:
        return
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:  # already gone
        descendants = []
    process.kill()
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()
    process.join(10)


def _log_tail(path: str | None, lines: int = 3) -> str:
    if not path or not pathlib.Path(path).exists():
        return ""
    tail = [line for line in pathlib.Path(path).read_text(errors="replace").splitlines() if line.strip()][-lines:]
    return ": " + " | ".join(tail)
