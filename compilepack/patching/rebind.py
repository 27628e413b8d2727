"""Run a stock transformers forward with some of its module globals swapped: the patching mechanism.

A transformers layer calls its kernels through module-level names (``causal_conv1d_fn(...)``,
``ALL_ATTENTION_FUNCTIONS.get_interface(...)``, ``create_causal_mask(...)``). compilepack installs its versions
under private names in the same module namespace (``__compilepack_<key>_causal_conv1d_fn``) and copies the layer's
``forward`` with a code object whose global loads of the stock names read the private names instead: the same
bytecode, only entries of ``co_names`` renamed. The copy keeps the stock module's own globals dict, so it sees
every other global as it is *now*: a patcher that rebinds a module global later or earlier (Liger-Kernel's
``apply_rotary_pos_emb``, a norm class, the kernels hub) composes with compilepack in either order. Nothing that
stock code reads is modified; other instances of the class stay stock.

Only ``LOAD_GLOBAL`` instructions are renamed (read with :mod:`dis`), so a forward that reaches a kernel another
way (``self.causal_conv1d_fn(...)``, an import inside the function) is reported as incompatible instead of
being silently left stock.

Some stacks drop ``**kwargs`` on the way from the decoder to a mixer or its kernel (the Mamba1 models,
``Mamba2ForCausalLM``). For those, named calls are *threaded*: the function's source is parsed, checked to compile
to exactly the loaded code, and recompiled with ``**__compilepack_boundaries__(kwargs)`` appended to each named
call, so the call also receives the batch's boundary kwargs from the function's own ``**kwargs``. The boundaries
travel as arguments (no state is written during a forward), so a gradient-checkpointing recompute sees them too.
"""

from __future__ import annotations

import ast
import dis
import inspect
import types
from collections.abc import Callable, Mapping

from ..batch.keys import BOUNDARY_KEYS, PACKED_BOUNDARIES
from ..errors import IncompatibleTransformersError

BOUNDARIES_HELPER = "__compilepack_boundaries__"  # the module global that threaded calls read


def private_name(key: str, name: str) -> str:
    """The name a replacement of global ``name`` is installed under (``key`` tells replacement sets apart)."""
    return f"__compilepack_{key}_{name}"


def install(module: types.ModuleType, key: str, replacements: Mapping[str, object]) -> dict[str, str]:
    """Put ``replacements`` (stock global name -> compilepack's object) into ``module`` under private names.

    Returns the renames (stock name -> private name) for :func:`with_globals`. Only new names are added: what
    stock code reads is untouched.
    """
    renames = {}
    for name, replacement in replacements.items():
        renames[name] = private_name(key, name)
        module.__dict__[renames[name]] = replacement
    module.__dict__[BOUNDARIES_HELPER] = boundary_kwargs
    return renames


def boundary_kwargs(kwargs: dict) -> dict:
    """The batch's boundary kwargs among a forward's ``**kwargs`` (those not None), the HF keys and the decoder's
    typed value: what a threaded call also receives. Empty for an unpacked batch, so the call is then exactly the
    stock one."""
    return {key: kwargs[key] for key in (*BOUNDARY_KEYS, PACKED_BOUNDARIES) if kwargs.get(key) is not None}


def global_loads(code: types.CodeType) -> set[str]:
    """Names ``code`` (and the code nested in it: comprehensions, lambdas) loads as globals."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_loads(const)
    return names


def with_globals(function: Callable, renames: Mapping[str, str], boundary_calls: tuple[str, ...] = ()) -> Callable:
    """Copy of ``function`` whose innermost code loads the globals in ``renames`` under their new names.

    transformers wraps forwards in decorators (``deprecate_kwarg``, ``merge_with_config_defaults``,
    ``capture_outputs``...) built with ``functools.wraps``. Each wrapper holds the function it wraps in a closure
    cell; the copy rebuilds the chain with new cells so the decorators still run, around the rebound innermost
    function. ``boundary_calls`` names calls in the innermost function, as written (``"self.mixer"``,
    ``"mamba_selective_scan"``), that must also receive the batch's boundary kwargs (see the module docstring).
    """
    inner = getattr(function, "__wrapped__", None)
    if inner is None:
        code = _threaded_code(function, boundary_calls) if boundary_calls else function.__code__
        return _copy_function(function, _renamed(code, renames, function), function.__closure__)
    if is_kernel_func_router(function):
        # the kernels package's use_kernelized_func wrapper (transformers 5.25): it sets a context variable routing the
        # layer's kernel functions to the instance's kernelized ones. compilepack patches only layers none of whose
        # functions is kernelized (api.py refuses the others), where the routing changes nothing, and under gradient
        # checkpointing its write is a side effect dynamo refuses inside the checkpoint ("HOP: Unsafe side effect")
        return with_globals(inner, renames, boundary_calls)
    new_inner = with_globals(inner, renames, boundary_calls)
    cells = function.__closure__ or ()
    if not any(_holds(cell, inner) for cell in cells):
        raise IncompatibleTransformersError(
            f"cannot rebind {function.__qualname__}: its decorator keeps the wrapped function outside a "
            "closure cell. This transformers version wraps forwards differently than compilepack expects."
        )
    new_cells = tuple(types.CellType(new_inner) if _holds(cell, inner) else cell for cell in cells)
    wrapper = _copy_function(function, function.__code__, new_cells)
    wrapper.__wrapped__ = new_inner
    return wrapper


def renamed_copy(function: Callable, renames: Mapping[str, str]) -> Callable:
    """Copy of ``function`` itself (not what it wraps) loading the globals in ``renames`` under their new names."""
    return _copy_function(function, _renamed(function.__code__, renames, function), function.__closure__)


def named_calls(function: Callable, names: tuple[str, ...]) -> dict[str, bool]:
    """The calls among ``names`` (as written: ``"self.mixer"``, ``"mamba_selective_scan"``) in ``function``'s
    undecorated source -> whether every one of them forwards a ``**`` mapping (and so receives the batch's boundary
    kwargs without threading). Calls absent from the source are absent from the result."""
    if not names:
        return {}
    inner = innermost(function)
    where = f"{inner.__module__}.{inner.__qualname__}"
    tree, _ = _module_source(inner, where)
    forwards: dict[str, bool] = {}
    for node in ast.walk(_definition(tree, inner.__code__)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in names:
            callee = ast.unparse(node.func)
            forwards[callee] = forwards.get(callee, True) and any(k.arg is None for k in node.keywords)
    return forwards


def is_kernel_func_router(function: Callable) -> bool:
    """Whether ``function`` is the forward the `kernels` package's ``use_kernelized_func`` wraps a layer's forward in
    (its ``new_forward``, under ``functools.wraps``: told apart by its code, which lives in the kernels package)."""
    code = getattr(function, "__code__", None)
    return code is not None and code.co_name == "new_forward" and "kernels" in code.co_filename.split("/")


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


def _copy_function(function: Callable, code: types.CodeType, closure) -> Callable:
    copy = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    copy.__module__ = function.__module__
    copy.__dict__.update(function.__dict__)
    # the signature is the stock one, annotations included (inspect.signature, Trainer and transformers' own
    # tests read it); FunctionType() does not carry them over
    copy.__annotations__ = dict(function.__annotations__)
    return copy


def _renamed(code: types.CodeType, renames: Mapping[str, str], function: Callable) -> types.CodeType:
    """``code`` with its global loads of ``renames``' keys reading the new names; nested code included."""
    other_uses = {i.argval for i in dis.get_instructions(code) if i.opcode in dis.hasname and i.opname != "LOAD_GLOBAL"}
    clash = sorted(other_uses & renames.keys() & global_loads(code))
    if clash:
        raise IncompatibleTransformersError(
            f"{function.__module__}.{function.__qualname__} uses {', '.join(clash)} both as a global and as an "
            "attribute or import name; compilepack can only rebind plain global loads."
        )
    names = tuple(renames.get(n, n) if n not in other_uses else n for n in code.co_names)
    consts = tuple(_renamed(c, renames, function) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_names=names, co_consts=consts)


# ------------------------------------------------------------------------------------------------ threading


def _threaded_code(function: Callable, calls: tuple[str, ...]) -> types.CodeType:
    """The code of ``function`` (undecorated, without closure) recompiled with ``**__compilepack_boundaries__(kwargs)``
    appended to each call named in ``calls`` (``kwargs`` being the function's own ``**`` parameter).

    The whole module source is parsed and compiled (a function compiled alone can differ: the compiler treats
    attributes of imported modules differently), after checking that the unmodified source compiles to exactly the
    loaded code; so the result is the stock code line for line plus the threaded kwargs, with the stock file name
    and line numbers.
    """
    code = function.__code__
    where = f"{function.__module__}.{function.__qualname__}"
    if code.co_freevars or not code.co_flags & inspect.CO_VARKEYWORDS:
        raise IncompatibleTransformersError(
            f"cannot pass the boundaries through {where}: it has a closure or no **kwargs parameter."
        )
    tree, filename = _module_source(function, where)
    if not _same_code(_compiled(tree, filename, code), code):
        raise IncompatibleTransformersError(
            f"cannot pass the boundaries through {where}: its source file does not match the loaded code (edited "
            "after import, or a different build); reinstall transformers."
        )
    definition = _definition(tree, code)
    positional = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
    threading = _BoundaryCalls(set(calls), code.co_varnames[positional], where)
    threading.visit(definition)
    missing = set(calls) - threading.found
    if missing:
        raise IncompatibleTransformersError(f"{where} no longer calls {', '.join(sorted(missing))}.")
    ast.fix_missing_locations(tree)
    return _compiled(tree, filename, code)


def _module_source(function: Callable, where: str) -> tuple[ast.Module, str]:
    try:
        filename = inspect.getsourcefile(function)
        source = inspect.getsource(inspect.getmodule(function))
    except (OSError, TypeError) as error:
        raise IncompatibleTransformersError(
            f"cannot pass the boundaries through {where}: its source is not available ({error}); compilepack needs "
            "transformers installed with its .py files."
        ) from error
    return ast.parse(source, filename), filename


def _definition(tree: ast.Module, code: types.CodeType) -> ast.FunctionDef:
    """The ``def`` node whose code object is ``code`` (by name and first line, decorators included)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            if min([node.lineno, *(d.lineno for d in node.decorator_list)]) == code.co_firstlineno:
                return node
    raise IncompatibleTransformersError(f"cannot find the source of {code.co_name} (line {code.co_firstlineno}).")


def _compiled(tree: ast.Module, filename: str, like: types.CodeType) -> types.CodeType:
    """The code object compiled from module ``tree`` that stands where ``like`` does (same name and first line)."""
    found = _find_code(compile(tree, filename, "exec", dont_inherit=True), like.co_name, like.co_firstlineno)
    if found is None:
        raise IncompatibleTransformersError(f"cannot find the code of {like.co_name} (line {like.co_firstlineno}).")
    return found


def _find_code(code: types.CodeType, name: str, first_line: int) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name and const.co_firstlineno == first_line:
                return const
            found = _find_code(const, name, first_line)
            if found is not None:
                return found
    return None


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Same bytecode, names, variables and constants (nested code compared alike); line numbers not compared."""
    if (a.co_code, a.co_names, a.co_varnames, a.co_argcount, a.co_kwonlyargcount) != (
        b.co_code, b.co_names, b.co_varnames, b.co_argcount, b.co_kwonlyargcount,
    ):
        return False
    if len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, types.CodeType) and isinstance(y, types.CodeType):
            if not _same_code(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


class _BoundaryCalls(ast.NodeTransformer):
    """Appends ``**__compilepack_boundaries__(<kwargs>)`` to every call whose callee reads as one of ``names``.

    A named call that already passes ``**something`` or a boundary keyword is refused: the appended kwargs would
    repeat a keyword, and the call would fail at run time with "got multiple values for keyword argument"."""

    def __init__(self, names: set[str], kwargs_name: str, where: str):
        self.names, self.kwargs_name, self.where, self.found = names, kwargs_name, where, set()

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        callee = ast.unparse(node.func)
        if callee in self.names:
            self._refuse_passed_boundaries(node, callee)
            self.found.add(callee)
            helper, kwargs = ast.Name(BOUNDARIES_HELPER, ast.Load()), ast.Name(self.kwargs_name, ast.Load())
            node.keywords.append(ast.keyword(arg=None, value=ast.Call(helper, [kwargs], [])))
        return node

    def _refuse_passed_boundaries(self, node: ast.Call, callee: str) -> None:
        passed = [k for k in node.keywords if k.arg is None or k.arg in BOUNDARY_KEYS]
        if passed:
            shown = ", ".join(f"**{ast.unparse(k.value)}" if k.arg is None else f"{k.arg}=" for k in passed)
            raise IncompatibleTransformersError(
                f"cannot pass the boundaries through {self.where}: its call {callee}(...) is named in the family's "
                f"boundary_calls but already passes {shown}, so the boundary kwargs would be given twice (\"multiple "
                f"values for keyword\" at run time). Remove {callee!r} from boundary_calls: a call that forwards "
                "**kwargs "
                "already receives the boundaries, and one that passes a boundary keyword itself cannot take them too."
            )
