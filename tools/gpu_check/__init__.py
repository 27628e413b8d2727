"""The GPU check (``python -m tools.gpu_check``; ``run`` holds the sections' order and budget): ``families`` (stock
beside patched, per family), ``ops`` (ops, layouts, known bugs, recompiles), ``probes`` (Hopper only),
``sequence``, ``lora``; ``common`` holds what they share. It imports compilepack, never benchmarks/."""
