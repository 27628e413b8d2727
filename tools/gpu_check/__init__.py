"""The GPU check (``python benchmarks/gpu_check.py``, the entry; ``run`` runs the sections in order): ``ops``
(ops, layouts, known bugs), ``compiles`` (recompiles, families), ``sequence``, ``long_rows``, ``speed``, ``lora``;
``common`` holds what they share."""
