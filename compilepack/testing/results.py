"""What a check returns: :class:`CheckResult`, and the rule every check keeps: a ``check_*`` function returns a
result whatever the model does (an error the model raises is a failed result carrying it), and its ``assert_*``
twin raises ``AssertionError`` (chained to that error) when the result failed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

# Each check's name in its result, in the table and the JSON of ``python -m compilepack check``, by the short key
# its ``--checks`` option takes.
CHECK_NAMES = {
    "packed": "packed == alone",
    "isolation": "isolation",
    "compile": "compile",
    "bf16": "bf16 autocast",
    "refusal": "refusal",
}


@dataclasses.dataclass
class CheckResult:
    """One check's outcome: ``passed``, the measured ``figure`` and the ``threshold`` it was held to, as text;
    ``details`` are the lines that explain a failure (break reasons, which batch leaked, error messages);
    ``error`` the exception the model raised when the check could not finish (then ``passed`` is False)."""

    name: str
    passed: bool
    figure: str
    threshold: str
    details: list[str] = dataclasses.field(default_factory=list)
    values: dict = dataclasses.field(default_factory=dict)  # the figures as numbers, for JSON
    error: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        text = f"{self.name} {verdict}: {self.figure} (threshold {self.threshold})"
        return text + "".join(f"\n  {line}" for line in self.details)


def guarded(name: str, threshold: str, run: Callable[[], CheckResult]) -> CheckResult:
    """``run()``'s result; when it raises, a failed result named ``name`` with the error's type and message.

    An error is a finding, not a crash of the check: a stock hybrid raising on boundary kwargs, a forward that
    cannot run a packed batch. Every ``check_*`` function runs its body through this, so none raises.
    """
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - whatever the model raises is the check's finding
        described = describe_error(error)
        return CheckResult(name, False, f"error: {type(error).__name__}", threshold,
                           [f"raised {described}"], {"error": described}, error)


def raise_unless(result: CheckResult) -> CheckResult:
    """``result`` when it passed, else ``AssertionError`` with its figures, chained to the model's error if any."""
    if not result.passed:
        raise AssertionError(str(result)) from result.error
    return result


def describe_error(error: BaseException, limit: int = 300) -> str:
    """``"ValueError: <first line of the message>"``, cut to ``limit`` characters."""
    return f"{type(error).__name__}: {first_line(error)[:limit]}"


def first_line(error: BaseException) -> str:
    """The first line of an error's message (transformers' messages run to paragraphs)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""
