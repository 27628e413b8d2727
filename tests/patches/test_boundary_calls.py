"""``Family.boundary_calls``: named calls in a stock forward also receive the batch's boundary kwargs."""

from __future__ import annotations

import functools
import types

import pytest

from compilepack.errors import IncompatibleTransformersError
from compilepack.patching.rebind import BOUNDARIES_HELPER, boundary_kwargs, innermost, with_globals


def inner(x, **kwargs):
    return x, kwargs


def _decorator(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


@_decorator
def forward(x, attention_mask=None, **kwargs):
    return inner(x, attention_mask=attention_mask)


def no_kwargs(x):
    return inner(x)


def _module():
    module = types.ModuleType("stand_in")
    module.__dict__.update(globals())
    module.__dict__[BOUNDARIES_HELPER] = boundary_kwargs
    return module


def test_named_call_receives_only_the_boundary_kwargs():
    threaded = with_globals(forward, _module(), ("inner",))
    _, received = threaded(1, seq_idx="s", cu_seq_lens_q="cu", max_length_q=None, labels="not a boundary")
    assert received == {"attention_mask": None, "cu_seq_lens_q": "cu", "seq_idx": "s"}
    assert forward(1, seq_idx="s")[1] == {"attention_mask": None}  # the stock function is untouched


def test_threaded_copy_keeps_decorators_file_and_line_numbers():
    threaded = with_globals(forward, _module(), ("inner",))
    assert threaded is not forward and hasattr(threaded, "__wrapped__")
    stock_code, copy_code = innermost(forward).__code__, innermost(threaded).__code__
    body_lines = lambda code: {line for *_, line in code.co_lines() if line is not None} - {code.co_firstlineno}  # noqa
    assert copy_code.co_filename == stock_code.co_filename
    assert body_lines(copy_code) == body_lines(stock_code)  # tracebacks point at the stock source


def test_a_call_the_forward_no_longer_makes_is_refused():
    with pytest.raises(IncompatibleTransformersError, match="no longer calls self.mixer"):
        with_globals(forward, _module(), ("self.mixer",))


def test_a_forward_without_kwargs_is_refused():
    with pytest.raises(IncompatibleTransformersError, match="no \\*\\*kwargs parameter"):
        with_globals(no_kwargs, _module(), ("inner",))
