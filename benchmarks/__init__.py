"""compilepack's benchmarks, run from a checkout: ``python -m benchmarks [command] [options]``.

- ``train`` (the default command): stock vs patched training steps on the same documents (``train``), at the
  bench widths or, with ``--widths real``, at each family's released widths;
- ``ops``: each sequence-mixing op alone (``ops/``);
- ``gpu-check``: the kernel paths on a lent GPU, one JSON (``python benchmarks/gpu_check.py``, the entry of
  ``tools/gpu_check/``);
- ``history``: rebuild the history table from result files (``history``).

The cost-table sweeps (``long-rows``, ``trainer-rows``, ``cp-memory``) are not the training benchmark: they live in
``tools/sweeps/`` (``python -m tools.sweeps <name>``), use this package's parts, and this package never imports
them.

Inside: ``data`` makes the documents and batches, ``modes`` says how each mode batches, patches and compiles,
``worker`` measures one mode (in its own process, see ``isolation``), ``rounds`` drives the paired rounds,
``bars`` checks the bars against the targets table of docs/benchmarks.md, ``report`` makes the JSON, markdown and
the plot, ``history`` writes them to the results folder and appends the history table.
Results: ``benchmarks/results/`` (the latest run of each kind, and ``history.csv``, a row per family and mode of
every run); lab notes (dated measurements, what was tried): ``benchmarks/notes/``; the guide: docs/benchmarks.md.

This package imports compilepack; compilepack never imports it (it is not in the wheel).
"""
