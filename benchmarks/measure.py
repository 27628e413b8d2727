"""What a mode measures about itself: step times, compile counters, peak memory, logits against each document
run alone."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import torch


class PeakRss:
    """Peak resident memory of this process above the RSS when it started, sampled by a background thread.

    A thread, not ``ru_maxrss``: the mode runs in a child forked from a process that already holds torch and
    transformers, and the peak of interest is what the mode itself adds (model, optimizer, activations, compile).
    Compile worker processes are not included. ``pause()`` stops the sampling while the mode waits for its next
    command (its memory does not change then, and a waiting worker should cost the timed one nothing);
    ``resume()`` starts it again.
    """

    def __init__(self, interval_s: float = 0.005):
        import psutil

        self._process = psutil.Process()
        self._interval_s = interval_s
        self.baseline = self._process.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._active = threading.Event()
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


def peak_memory_mb(device: torch.device, rss: PeakRss) -> float:
    """Max allocated on CUDA, RSS above the mode's baseline elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return rss.stop_mb()


def synchronizer(device: torch.device):
    """A function that waits for queued device work (so a timer measures it), or does nothing on CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class CompileCounters:
    """dynamo's counters as deltas since construction: graphs compiled and graph breaks taken."""

    def __init__(self):
        from torch._dynamo.utils import counters

        self._counters = counters
        self._graphs0 = self.graphs_total()
        self._breaks0 = self.breaks_total()

    def graphs_total(self) -> int:
        return int(self._counters["stats"]["unique_graphs"])

    def breaks_total(self) -> int:
        return int(sum(self._counters["graph_break"].values()))

    @property
    def graphs(self) -> int:
        return self.graphs_total() - self._graphs0

    @property
    def breaks(self) -> int:
        return self.breaks_total() - self._breaks0

    def break_reasons(self, limit: int = 3) -> list[str]:
        return [reason.strip().splitlines()[0][:200] for reason in list(self._counters["graph_break"])[:limit]]


@contextlib.contextmanager
def timed():
    """``with timed() as t: ...`` then ``t()`` is the elapsed seconds."""
    start = time.perf_counter()
    end = None

    def elapsed() -> float:
        return (end if end is not None else time.perf_counter()) - start

    try:
        yield elapsed
    finally:
        end = time.perf_counter()


def process_tree_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and every live descendant, with the children each
    has waited for: a compile's g++ runs happen in inductor's compile-worker processes. Unlike wall time it does
    not grow when other processes share the cores, so compiles taken side by side stay comparable."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a compile worker that just exited
            times = process.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def doc_spans(batch: dict, docs: list[list[int]]) -> list[tuple[int, int, int]]:
    """(row, start, end) of each of ``docs`` inside ``batch``: row ``i`` of a padded batch, or wherever the
    document's tokens sit in a packed batch (collators may reorder documents)."""
    if "attention_mask" in batch:
        return [(row, 0, len(doc)) for row, doc in enumerate(docs)]
    flat = batch["input_ids"].reshape(-1).tolist()
    cu = batch["cu_seq_lens_q"].tolist()
    where = {tuple(flat[s:e]): s for s, e in itertools.pairwise(cu) if e > s}
    spans = []
    for doc in docs:
        start = where[tuple(doc)]
        spans.append((0, start, start + len(doc)))
    return spans


def logits_alone(model: torch.nn.Module, docs: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Each document's logits when it is the whole batch: the ground truth a packed row must reproduce."""
    with torch.no_grad():
        return [model(input_ids=torch.tensor([doc], device=device), use_cache=False).logits[0].float() for doc in docs]


def max_logit_diff(logits: torch.Tensor, spans, alone: list[torch.Tensor]) -> float:
    """Largest |logit difference| between the documents inside a batch and the same documents run alone."""
    logits = logits.detach().float()
    return max((logits[row, s:e] - ref).abs().max().item() for (row, s, e), ref in zip(spans, alone))


# glibc mallopt parameters (malloc.h); a trim threshold of -1 turns trimming off (mallopt(3))
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_NEVER_TRIM = -1


def keep_freed_memory() -> bool:
    """Make this process's allocator keep freed memory for reuse, as PyTorch's CUDA caching allocator does on a GPU:
    glibc serves every block above its mmap threshold (32 MB at most) with a fresh ``mmap`` and unmaps it when
    freed, so each training step page-faults (the kernel zero-fills) every such tensor again. On a 64k-token row of
    the Qwen3.5 bench model that is 4.3 M page faults (17 GB zero-filled) and ~40% of the step's CPU time, in
    stock and patched models alike. With mmap off and the heap never trimmed, freed blocks stay in the heap and are
    reused, and the process holds its high-water mark, as a caching allocator does. Never trimmed, not trimmed
    above a threshold: the largest positive threshold mallopt takes is 2 GB, which a stock padded hybrid step,
    peaking near 6 GB, exceeds; trimmed there, some runs faulted 0.15-0.7 M pages again in every later step (7.4-8.1
    s a step against 6.7-7.9 s untrimmed). Returns False where there is no glibc (nothing changed)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none): other processes slow every figure."""
    import os

    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
