"""What a mode measures about itself: compile counters, CPU seconds, peak memory, where each document sits."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading

import torch
from torch._dynamo.utils import counters


class PeakRss:
    """Peak resident memory of this process above its RSS at the start, sampled by a thread (not ``ru_maxrss``:
    the worker is forked from a process that already holds torch, and the peak of interest is what the mode adds).
    ``pause()`` stops the sampling while the mode waits for its next command, ``resume()`` starts it again."""

    def __init__(self, interval_s: float = 0.005):
        import psutil

        self._process = psutil.Process()
        self._interval_s = interval_s
        self.baseline = self.peak = self._process.memory_info().rss
        self._stop, self._active = threading.Event(), threading.Event()
        self._active.set()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._active.wait()
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(self._interval_s)

    def pause(self) -> None:
        self.peak = max(self.peak, self._process.memory_info().rss)
        self._active.clear()

    def resume(self) -> None:
        self._active.set()

    def stop_mb(self) -> float:
        self._stop.set()
        self._active.set()  # wake a paused sampler so it sees the stop
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        return (self.peak - self.baseline) / 2**20


def synchronizer(device: torch.device):
    """A function that waits for queued device work (so a timer measures it), or does nothing on CPU."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


class CompileCounters:
    """dynamo's counters as deltas since construction: graphs compiled and graph breaks taken."""

    def __init__(self):
        self._graphs0, self._breaks0 = self.graphs_total(), self.breaks_total()

    def graphs_total(self) -> int:
        return int(counters["stats"]["unique_graphs"])

    def breaks_total(self) -> int:
        return int(sum(counters["graph_break"].values()))

    @property
    def graphs(self) -> int:
        return self.graphs_total() - self._graphs0

    @property
    def breaks(self) -> int:
        return self.breaks_total() - self._breaks0

    def break_reasons(self, limit: int = 3) -> list[str]:
        return [reason.strip().splitlines()[0][:200] for reason in list(counters["graph_break"])[:limit]]


def process_tree_cpu_s() -> float:
    """CPU seconds used so far by this process and its descendants (inductor's compile workers run g++): unlike
    wall time it does not grow when other processes share the cores."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a compile worker that just exited
            times = process.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def doc_spans(batch: dict, docs: list[list[int]]) -> list[tuple[int, int]]:
    """(start, end) of each of ``docs`` in the flattened tokens of ``batch``: row ``i`` of a padded batch, or
    wherever the document's tokens sit in a packed batch (collators may reorder documents)."""
    if "attention_mask" in batch:
        length = batch["input_ids"].shape[1]
        return [(row * length, row * length + len(doc)) for row, doc in enumerate(docs)]
    flat, cu = batch["input_ids"].reshape(-1).tolist(), batch["cu_seq_lens_q"].tolist()
    where = {tuple(flat[s:e]): s for s, e in itertools.pairwise(cu) if e > s}
    return [(where[tuple(doc)], where[tuple(doc)] + len(doc)) for doc in docs]


# glibc mallopt parameters (malloc.h); a trim threshold of -1 turns trimming off (mallopt(3))
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_NEVER_TRIM = -1


def keep_freed_memory() -> bool:
    """Keep freed memory for reuse, as a GPU's caching allocator does (why: docs/benchmarks.md, "The allocator"):
    mmap off and the heap never trimmed (a trim threshold caps at 2 GB, below a padded hybrid step's ~6 GB).
    Returns False where there is no glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none): other processes slow every figure."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
