"""Stand-ins the benchmark's tests share: a worker that records the driver's calls, a mode's result from
per-round throughputs, and one mode measured in this process."""

from __future__ import annotations

from benchmarks.worker import ModeSession, ModeSpec, summarize_rounds


class FakeWorker:
    """Records the driver's calls; fails where told."""

    def __init__(self, mode, calls, fail_ready=False, fail_round=None, round_steps=None):
        self.spec, self.result, self.calls = mode, {"mode": mode, "error": None}, calls
        self.fail_ready, self.fail_round, self.round_steps = fail_ready, fail_round, round_steps

    def start(self):
        self.calls.append(("start", self.spec))

    def await_ready(self, timeout_s):
        self.calls.append(("ready", self.spec))
        if self.fail_ready:
            self.result["error"] = "ValueError: refused"
        if self.round_steps:
            self.result["round_steps"] = self.round_steps
        return not self.fail_ready

    def run_round(self, index, position, timeout_s, part=None):
        self.calls.append(("round", index, position, self.spec) + ((part,) if self.round_steps else ()))
        if index == self.fail_round:
            self.result["error"] = "TimeoutError: did not finish round 2"
            return False
        return True

    def finish(self, timeout_s):
        self.calls.append(("finish", self.spec))
        return self.result

    def stop(self):
        pass


def result_of(mode, per_round, family="llama", compiled=()):
    timed = [{"round": r, "position": 0, "tokens": 1000, "seconds": 1000 / tps, "load_avg": 1.0,
              "compiled": r in compiled} for r, tps in enumerate(per_round) if tps]
    return {"family": family, "mode": mode, "error": None, **summarize_rounds(timed)}


def measure_mode(spec: ModeSpec) -> dict:
    """Every figure of one mode on its own, in this process: warm up, every round, finish."""
    session = ModeSession(spec)
    if session.prepare():
        for index in range(spec.workload.steps):
            if not session.run_round(index):
                break
    return session.finish()
