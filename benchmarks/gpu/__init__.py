"""The GPU check's sections (``benchmarks/gpu_check.py`` runs them in order): ``ops`` (ops, layouts, known
bugs), ``compiles`` (recompiles, families), ``long_rows``, ``speed``; ``common`` holds what they share."""
