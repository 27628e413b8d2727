"""The training bench's optional dependencies, checked before it starts (the ``bench`` extra installs them all).

A run takes minutes, so a package it needs must be found missing before the first model is built, not when the
report is written: psutil (peak memory, stopping a runaway worker), tqdm (the progress bar) and rich (the console
table) are needed, and their absence stops the run at once with the install command; without matplotlib the run
still writes its JSON and markdown, skips only the plot, and says so at the start and at the end.
"""

from __future__ import annotations

import dataclasses
import importlib

INSTALL_ALL = 'pip install -e ".[bench]"  (in the checkout)'


@dataclasses.dataclass(frozen=True)
class Dependency:
    module: str
    package: str  # what pip installs
    used_for: str
    required: bool  # False: the run goes on without what it is used for


DEPENDENCIES = (
    Dependency("psutil", "psutil", "peak memory per mode and stopping a worker's compile processes", True),
    Dependency("tqdm", "tqdm", "the progress bar", True),
    Dependency("rich", "rich", "the console table", True),
    Dependency("matplotlib", "matplotlib", "the PNG plot", False),
)


def missing(dependencies=DEPENDENCIES) -> list[Dependency]:
    """The dependencies that cannot be imported here."""
    return [dep for dep in dependencies if not _importable(dep.module)]


def check(plot: bool = True, warn=print) -> bool:
    """Stop (``SystemExit`` naming each missing package, what it is for and the install command) when a required
    package is missing; warn when matplotlib is. Returns whether the plot can be drawn (``plot`` and matplotlib
    importable)."""
    absent = missing()
    required = [dep for dep in absent if dep.required]
    if required:
        lines = [f"  {dep.package}: {dep.used_for}" for dep in required]
        raise SystemExit(
            "the benchmark needs packages that are not installed:\n" + "\n".join(lines)
            + f"\nInstall them with: pip install {' '.join(dep.package for dep in required)}\n"
            + f"or every bench extra with: {INSTALL_ALL}"
        )
    can_plot = plot and not any(dep.module == "matplotlib" for dep in absent)
    if plot and not can_plot:
        warn("warning: matplotlib is not installed, so this run writes no PNG plot (the JSON and markdown are "
             "written as usual). Install it with: pip install matplotlib")
    return can_plot


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
