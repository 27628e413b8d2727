"""``python -m compilepack bench``: stock vs patched training steps on the same documents (see docs/benchmarks.md).

``data`` makes the documents and batches, ``modes`` says how each mode batches, patches and compiles,
``worker`` measures one mode (in its own process, see ``isolation``), ``bars`` checks the issue's bars,
``report`` writes JSON, markdown and the plot, ``main`` is the command.
"""
