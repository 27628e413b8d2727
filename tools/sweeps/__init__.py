"""The cost-table sweeps, run from a checkout: ``python -m tools.sweeps long-rows|trainer-rows|cp-memory [options]``.
They are not the training benchmark (``python -m benchmarks``); they write the cost tables the docs publish:

- ``long-rows``: a training step's cost against the tokens per row (``long_rows``; docs/benchmarks.md,
  docs/long-rows.md);
- ``trainer-rows``: HF Trainer and SFTTrainer steps at real vocabularies, 4k-32k rows (``trainer_rows``;
  docs/long-rows.md);
- ``cp-memory``: peak memory per rank under context parallelism, W = 1, 2, 4 (``cp_memory``; docs/long-rows.md,
  docs/context-parallel-evidence.md).

The three share ``sweep`` (options, child processes under a memory limit, the report, the plot's panels). They use
the benchmark's parts (``benchmarks.rounds``, ``worker``, ``data``, ``history``...) and write to
``benchmarks/results`` (and, for ``long-rows``, its ``history.csv``); ``benchmarks`` never imports them.
"""
