"""``bench_config(name)``: the family's benchmark model config (``Family.bench``). Only the GPU check
(tools/gpu_check/) imports it: its rework to import compilepack only removes that import, and this file with it."""

from compilepack.patching import family_named


def bench_config(family_name: str):
    return family_named(family_name).bench_config()
