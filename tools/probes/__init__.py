"""Probes: one-off measurements behind a figure in the notes (``benchmarks/notes/``), each run as
``python -m tools.probes.<name>`` from a checkout. Not part of the benchmark's command."""
