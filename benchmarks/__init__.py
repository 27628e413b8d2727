"""compilepack's training benchmark, run from a checkout: ``python -m benchmarks [train] [options]``.

``data`` makes the documents, ``modes`` says how each mode batches, patches and compiles, ``worker`` measures one
mode in its own process (``isolation``), ``rounds`` drives the paired rounds, ``bars`` holds the targets and checks
them, ``report`` writes the JSON, markdown and plot, ``history`` the results folder. The guide: docs/benchmarks.md.
"""
