"""Placeholder replaced by the benchmark implementation."""


def add_arguments(parser):
    pass


def run(args) -> int:
    raise SystemExit("the benchmark is not written yet")
