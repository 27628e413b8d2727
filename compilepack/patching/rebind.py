"""Run a stock transformers forward with some of its module globals swapped: the patching mechanism.

A transformers layer calls its kernels through module-level names (``causal_conv1d_fn(...)``,
``ALL_ATTENTION_FUNCTIONS.get_interface(...)``, ``create_causal_mask(...)``). compilepack copies the layer's
``forward`` function with a globals dict in which exactly those names point at compilepack's boundary-aware
versions, and binds the copy to one module instance. The stock code runs unchanged, line for line; only the
names it looks up differ. Nothing global is modified: other instances of the same class stay stock.

The copies' globals live in a real module object registered in ``sys.modules`` so that ``torch._dynamo`` can
guard on them by name, as it does for any module global.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import sys
import textwrap
import types
from collections.abc import Callable, Mapping

from ..boundaries import BOUNDARY_KEYS
from ..errors import IncompatibleTransformersError

BOUNDARIES_HELPER = "__compilepack_boundaries__"  # the rebound-module global that threaded calls read

_REBOUND_PREFIX = "compilepack._rebound"
_rebound_modules: dict[tuple, types.ModuleType] = {}


def rebound_module(stock: types.ModuleType, replacements: Mapping[str, object], key: tuple) -> types.ModuleType:
    """A copy of module ``stock`` with ``replacements`` applied, one per (module, key), registered in sys.modules.

    ``key`` identifies the replacement set (e.g. the chosen backends): the same key gives the same module,
    so every patched instance shares one set of function copies and one compiled graph.
    """
    cache_key = (stock.__name__, key)
    module = _rebound_modules.get(cache_key)
    if module is None:
        digest = hashlib.sha1(repr(cache_key).encode()).hexdigest()[:10]
        name = f"{_REBOUND_PREFIX}.{stock.__name__.replace('.', '_')}_{digest}"
        module = types.ModuleType(name, stock.__doc__)
        module.__dict__.update({k: v for k, v in stock.__dict__.items() if k not in ("__name__", "__spec__")})
        module.__dict__.update(replacements)
        module.__dict__[BOUNDARIES_HELPER] = boundary_kwargs
        module.__dict__["__compilepack_stock__"] = stock
        sys.modules[name] = module
        _rebound_modules[cache_key] = module
    return module


def boundary_kwargs(kwargs: dict) -> dict:
    """The batch's boundary kwargs among a forward's ``**kwargs`` (those not None): what a threaded call also
    receives. Empty for an unpacked batch, so the call is then exactly the stock one."""
    return {key: kwargs[key] for key in BOUNDARY_KEYS if kwargs.get(key) is not None}


def with_globals(function: Callable, module: types.ModuleType, boundary_calls: tuple[str, ...] = ()) -> Callable:
    """Copy of ``function`` whose innermost code reads globals from ``module``; decorators are kept.

    transformers wraps forwards in decorators (``deprecate_kwarg``, ``merge_with_config_defaults``,
    ``capture_outputs``...) built with ``functools.wraps``. Each wrapper holds the function it wraps in a
    closure cell; the copy rebuilds the chain with new cells so the decorators still run, around the
    rebound innermost function.

    ``boundary_calls`` names calls in the innermost function, as written (``"self.mixer"``,
    ``"mamba_selective_scan"``), that must also receive the batch's boundary kwargs, for models whose forwards
    drop ``**kwargs`` on the way to a mixer or its kernel: see :func:`_copy_with_boundary_calls`.
    """
    inner = getattr(function, "__wrapped__", None)
    if inner is None:
        if boundary_calls:
            return _copy_with_boundary_calls(function, module, boundary_calls)
        return _copy_function(function, function.__closure__, module.__dict__)
    new_inner = with_globals(inner, module, boundary_calls)
    cells = function.__closure__ or ()
    if not any(_holds(cell, inner) for cell in cells):
        raise IncompatibleTransformersError(
            f"cannot rebind {function.__qualname__}: its decorator keeps the wrapped function outside a "
            "closure cell. This transformers version wraps forwards differently than compilepack expects."
        )
    new_cells = tuple(types.CellType(new_inner) if _holds(cell, inner) else cell for cell in cells)
    wrapper = _copy_function(function, new_cells, function.__globals__)
    wrapper.__wrapped__ = new_inner
    return wrapper


def innermost(function: Callable) -> Callable:
    """The undecorated function under a chain of ``functools.wraps`` decorators."""
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function


def _holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _copy_function(function: Callable, closure, globals_dict: dict) -> Callable:
    copy = types.FunctionType(function.__code__, globals_dict, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    copy.__module__ = function.__module__
    copy.__dict__.update(function.__dict__)
    return copy


def _copy_with_boundary_calls(function: Callable, module: types.ModuleType, calls: tuple[str, ...]) -> Callable:
    """Copy of ``function`` (undecorated, without closure) recompiled from its source with
    ``**__compilepack_boundaries__(kwargs)`` appended to each call named in ``calls`` (``kwargs`` being the
    function's own ``**`` parameter): the stock code line for line, plus the boundary kwargs where the model
    would drop them. Globals come from ``module``; file name and line numbers stay the stock ones."""
    code = function.__code__
    where = f"{function.__module__}.{function.__qualname__}"
    if code.co_freevars or not code.co_flags & inspect.CO_VARKEYWORDS:
        raise IncompatibleTransformersError(
            f"cannot pass the boundaries through {where}: it has a closure or no **kwargs parameter."
        )
    positional = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
    lines, first_line = inspect.getsourcelines(function)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    definition = tree.body[0]
    definition.decorator_list = []  # the decorators stay on the stock chain, which with_globals rebuilds
    threading = _BoundaryCalls(set(calls), code.co_varnames[positional])
    threading.visit(definition)
    missing = set(calls) - threading.found
    if missing:
        raise IncompatibleTransformersError(f"{where} no longer calls {', '.join(sorted(missing))}.")
    ast.increment_lineno(ast.fix_missing_locations(tree), first_line - 1)  # the added nodes sit on their call's line
    namespace: dict = {}
    exec(compile(tree, code.co_filename, "exec"), module.__dict__, namespace)
    copy = namespace[definition.name]
    copy.__defaults__, copy.__kwdefaults__ = function.__defaults__, function.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = function.__qualname__, function.__doc__, function.__module__
    copy.__dict__.update(function.__dict__)
    return copy


class _BoundaryCalls(ast.NodeTransformer):
    """Appends ``**__compilepack_boundaries__(<kwargs>)`` to every call whose callee reads as one of ``names``."""

    def __init__(self, names: set[str], kwargs_name: str):
        self.names, self.kwargs_name, self.found = names, kwargs_name, set()

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        callee = ast.unparse(node.func)
        if callee in self.names:
            self.found.add(callee)
            helper, kwargs = ast.Name(BOUNDARIES_HELPER, ast.Load()), ast.Name(self.kwargs_name, ast.Load())
            node.keywords.append(ast.keyword(arg=None, value=ast.Call(helper, [kwargs], [])))
        return node
