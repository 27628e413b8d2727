"""One declaration -> a ``compilepack::`` custom op with its fake, its backward op and its autograd.

Every compilepack op has the same shape: a forward that returns the output (or several, ``outputs=``) and the
tensors its backward needs (``saved``), a backward that returns one gradient per differentiable input, a fake for
the compiler, and several ways to compute both (the pure-torch reference, and kernel libraries on CUDA). An op
module declares only what is particular to it::

    op = define_op(
        "compilepack::gated_delta_rule_varlen",
        signature=_signature,                  # a stub: annotated inputs (the schema), ``backend: str`` last
        differentiable=("q", "k", "v", "g", "beta"),
        reference=reference.PATH,              # Path(forward, backward, fake)
        kernels={"fla": fla.PATH},             # backend name -> Path, best first, used on CUDA only
        kind="delta_rule",                     # patch(backend={"delta_rule": "fla"}) names it with KDA
    )
    out = op(q, k, v, g, beta, cu_seqlens, True, scale, "fla")

and this module registers, from that:

- the forward op ``name``: ``(*inputs) -> (out, saved: Tensor[])``, dispatching to one path; an op declaring
  several ``outputs`` (``("out", "final_state")``) returns ``(out, final_state, saved)``;
- the backward op ``name + "_backward"``: ``(grad_out, out?, saved, needs_grad: bool[], *inputs) -> Tensor[]``
  (one gradient per differentiable input; an empty placeholder for an absent optional input), so the compiler
  sees the backward as one opaque call too; with several outputs it takes one gradient per output first
  (``grad_out, grad_final_state, ...``), zeros for an output that does not reach the loss;
- the fakes of both (the forward's from the chosen path, the backward's from the inputs' layouts);
- the autograd formula (``register_autograd``) that saves the inputs, ``saved`` and optionally ``out``.

Which path runs is decided from static facts only (the ``backend`` string chosen at ``patch()`` time, the
device type, shapes), identically for the real op, its fake and its backward, so the compiled graph never
branches on tensor data and the fake always describes what actually runs.

Path bodies run with autocast off: a custom op is opaque to autocast, but the autocast state stays on inside
its body, where it would silently recast the reference's fp32 arithmetic (and mix dtypes in its matmuls).
Each op decides its compute dtype itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from . import backends
from ..batch.rules import refuse_steps_back

PLACEHOLDER_SHAPE = (0,)  # what the backward op returns for an optional input that was None


@dataclasses.dataclass(frozen=True)
class Path:
    """One way to compute an op.

    ``forward(*inputs)`` returns ``(out, saved)`` (``(*outputs, saved)`` for an op with several outputs);
    ``backward(grad_out, out, saved, needs_grad, *inputs)`` (``(*grads, out, saved, ...)``: one gradient per
    output) returns one gradient per differentiable input (None where not needed or absent); ``fake(*inputs)``
    returns empty tensors with the shapes, dtypes and strides ``forward`` produces. ``inputs`` are the op's inputs
    without the trailing ``backend`` string.
    """

    forward: Callable[..., tuple[Tensor | list[Tensor], ...]]
    backward: Callable[..., Sequence[Tensor | None]]
    fake: Callable[..., tuple[Tensor | list[Tensor], ...]]


@dataclasses.dataclass(frozen=True)
class Op:
    """A registered op: call it like the forward op; ``forward`` / ``backward`` are the registered custom ops."""

    name: str
    forward: Callable
    backward: Callable
    path_of: Callable[..., Path]
    backend_op: str  # the op name ``Backends`` keys this op's backend by (a helper form's: its public op's)

    def __call__(self, *inputs):
        return self.forward(*inputs)


def define_op(
    name: str,
    *,
    signature: Callable,
    differentiable: tuple[str, ...],
    reference: Path,
    kernels: Mapping[str, Path] | None = None,
    kernel_applies: Callable[..., bool] | None = None,
    outputs: tuple[str, ...] = ("out",),
    saves_output: bool = False,
    boundaries: tuple[str, ...] = (),
    kind: str | None = None,
    follows: str | None = None,
) -> Op:
    """Register the custom op ``name`` (``"compilepack::..."``), its backward op, fakes and autograd.

    Args:
        name: the qualified op name.
        signature: a stub whose annotated parameters are the op's inputs, ending in ``backend: str``.
        differentiable: the names of the inputs that receive gradients (tensors, possibly optional).
        reference: the pure-torch path (any device; what always runs on CPU).
        kernels: backend name -> path, used when the first input is on CUDA and ``backend`` names it.
        kernel_applies: static predicate on the inputs (shapes, dtypes) that a kernel path also needs; inputs
            it refuses run the reference.
        outputs: the names of the output tensors; several (``("out", "final_state")``) make the forward return
            ``(*outputs, saved)`` and the backward take ``grad_<name>`` for each, as their schemas say.
        saves_output: whether the backward needs the forward's (first) output (then saved too).
        boundaries: the inputs that hold document boundaries (``cu_seqlens``, its host copy ``cu_seqlens_cpu``,
            ``seq_idx``): the forward refuses them when they decrease, before any compute, where they can be read
            for free: on the host, and from the host copy when one is given (``batch.rules.refuse_steps_back``).
        kind: the op kind ``patch(backend={kind: ...})`` names this op by, with the other ops its libraries serve.
        follows: the op whose backend choice this helper op takes (``"varlen_attention"`` for its ``_kv`` form);
            default: its own name without the namespace. The kernels are what ``patch()`` chooses among
            (``backends.declare``), so an op's candidates are declared here and nowhere else.
    """
    backend_op = follows or name.removeprefix("compilepack::")
    backends.declare(backend_op, kernels or {}, kind)
    parameters = _op_parameters(name, signature, differentiable + boundaries)
    names = [p.name for p in parameters]
    grad_positions = tuple(names.index(n) for n in differentiable)
    boundary_inputs = tuple((names.index(n), n) for n in boundaries)
    paths = _Paths(name, backend_op, reference, dict(kernels or {}), kernel_applies, grad_positions,
                   boundary_inputs, len(outputs))

    # 1. the forward op, ``(*inputs) -> (*outputs, saved)``, and its fake
    forward_op = _custom_op(name, paths.forward, parameters, tuple[(Tensor,) * len(outputs) + (list[Tensor],)])
    forward_op.register_fake(paths.forward_fake)

    # 2. the backward op, ``(*grads, out?, saved, needs_grad, *inputs) -> grads``, and its fake: the compiler sees
    #    the backward as one opaque call too
    backward_parameters = [
        *(_parameter(f"grad_{output}", Tensor) for output in outputs),
        _parameter("out", Tensor | None),
        _parameter("saved", list[Tensor]),
        _parameter("needs_grad", list[bool]),
        *parameters,
    ]
    backward_op = _custom_op(f"{name}_backward", paths.backward, backward_parameters, list[Tensor])
    backward_op.register_fake(paths.backward_fake)

    # 3. autograd: the forward op saves its inputs, ``saved`` (and ``out``); its gradient is the backward op
    autograd = _Autograd(backward_op, len(parameters), grad_positions, len(outputs), saves_output)
    forward_op.register_autograd(autograd.backward, setup_context=autograd.setup_context)
    return Op(name, forward_op, backward_op, paths.path_of, backend_op)


def _op_parameters(name: str, signature: Callable, named: tuple[str, ...]) -> list[inspect.Parameter]:
    parameters = list(inspect.signature(signature).parameters.values())
    if parameters[-1].name != "backend":
        raise TypeError(f"{name}: the signature's last parameter must be 'backend: str'.")
    unknown = set(named) - {p.name for p in parameters}
    if unknown:
        raise TypeError(f"{name}: inputs {sorted(unknown)} (differentiable or boundaries) are not in the signature.")
    return parameters


@dataclasses.dataclass(frozen=True, eq=False)
class _Paths:
    """The op's paths, and the one choice among them that the real op, its fake and its backward all make.

    Every method takes the op's inputs with the ``backend`` string last, as the registered ops receive them."""

    name: str
    backend_op: str
    reference: Path
    kernels: Mapping[str, Path]
    kernel_applies: Callable[..., bool] | None
    grad_positions: tuple[int, ...]  # where the differentiable inputs are among the inputs
    boundary_inputs: tuple[tuple[int, str], ...]  # (position, name) of the boundary inputs
    output_count: int

    def path_of(self, *inputs) -> Path:
        backend = inputs[-1]
        _check_backend(self.name, self.backend_op, backend)
        kernel = self.kernels.get(backend)
        if kernel is None or not backends.use_kernel(inputs[0], backend):
            return self.reference
        if self.kernel_applies is not None and not self.kernel_applies(*inputs[:-1]):
            return self.reference
        return kernel

    def forward(self, *inputs):
        self._refuse_decreasing_boundaries(inputs)
        with _autocast_off(inputs[0]):
            return self.path_of(*inputs).forward(*inputs[:-1])

    def _refuse_decreasing_boundaries(self, inputs) -> None:
        """Boundaries that decrease are refused before any compute; a host copy (``cu_seqlens_cpu``), when given,
        is checked instead of the tensor it copies, so boundaries on a GPU are never read back."""
        given = {argument: inputs[position] for position, argument in self.boundary_inputs}
        for argument, boundaries in given.items():
            if given.get(f"{argument}_cpu") is None:
                refuse_steps_back(self.name.removeprefix("compilepack::"), argument, boundaries)

    def forward_fake(self, *inputs):
        return self.path_of(*inputs).fake(*inputs[:-1])

    def backward(self, *arguments):
        """``(*grads, out, saved, needs_grad, *inputs)``: one gradient per output first."""
        inputs = arguments[self.output_count + 3 :]
        with _autocast_off(inputs[0]):
            grads = self.path_of(*inputs).backward(*arguments[: self.output_count + 3], *inputs[:-1])
        return [_as_gradient(grad, inputs[i]) for grad, i in zip(grads, self.grad_positions)]

    def backward_fake(self, *arguments):
        inputs = arguments[self.output_count + 3 :]
        return [_gradient_like(inputs[i]) for i in self.grad_positions]


@dataclasses.dataclass(frozen=True, eq=False)
class _Autograd:
    """``register_autograd``'s two functions for one op: save the inputs, ``saved`` and optionally ``out``; then
    call the backward op with them and hand each gradient to its input."""

    backward_op: Callable
    input_count: int
    grad_positions: tuple[int, ...]
    output_count: int
    saves_output: bool

    def setup_context(self, ctx, inputs, output):
        *outs, saved = output
        out = outs[0]
        ctx.mark_non_differentiable(*saved)
        # no zero-filled gradients for ``saved``; those of unused outputs are made in ``backward``, from their layouts
        ctx.set_materialize_grads(False)
        ctx.output_layouts = [(o.shape, o.dtype, o.device) for o in outs] if self.output_count > 1 else None
        # save_for_backward takes tensors (or None) only: the other inputs (ints, bools, the backend) stay on ctx
        tensor_positions = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) or x is None]
        ctx.others = {i: x for i, x in enumerate(inputs) if i not in tensor_positions}
        ctx.tensor_positions = tensor_positions
        ctx.save_for_backward(*(inputs[i] for i in tensor_positions), out if self.saves_output else None, *saved)

    def backward(self, ctx, *grads_of_outputs):
        grads_out = grads_of_outputs[: self.output_count]  # then ``saved``'s, never used
        if all(grad is None for grad in grads_out):  # no output reaches the loss
            return (None,) * self.input_count
        if self.output_count > 1:  # some outputs may not reach the loss: the backward op takes zeros for them
            grads_out = [
                torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad
                for grad, (shape, dtype, device) in zip(grads_out, ctx.output_layouts)
            ]
        inputs, out, saved = self._saved_inputs(ctx)
        needs_grad = [bool(ctx.needs_input_grad[i]) and inputs[i] is not None for i in self.grad_positions]
        grads = self.backward_op(*grads_out, out, saved, needs_grad, *inputs)
        result = [None] * self.input_count
        for i, grad, needed in zip(self.grad_positions, grads, needs_grad):
            result[i] = grad if needed else None
        return tuple(result)

    def _saved_inputs(self, ctx) -> tuple[list, Tensor | None, list[Tensor]]:
        """The op's inputs (tensors from ``saved_tensors``, the rest from ``ctx.others``), ``out`` and ``saved``."""
        tensors = ctx.saved_tensors
        count = len(ctx.tensor_positions)
        inputs = [None] * self.input_count
        for i, tensor in zip(ctx.tensor_positions, tensors[:count]):
            inputs[i] = tensor
        for i, value in ctx.others.items():
            inputs[i] = value
        return inputs, tensors[count], list(tensors[count + 1 :])


def _custom_op(name: str, impl: Callable, parameters: list[inspect.Parameter], returns) -> Callable:
    """``torch.library.custom_op(name)`` running ``impl(*inputs)``, with the schema ``parameters -> returns``."""

    def positional(*inputs):
        return impl(*inputs)

    # custom_op infers the schema from the function's signature: give it the op's, which ``impl`` does not spell
    positional.__signature__ = inspect.Signature(
        [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD, default=inspect.Parameter.empty) for p in parameters],
        return_annotation=returns,
    )
    return torch.library.custom_op(name, positional, mutates_args=())


def _parameter(name: str, annotation) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)


def _check_backend(name: str, backend_op: str, backend: str) -> None:
    known = backends.candidates(backend_op)
    if backend not in known:
        raise ValueError(f"{name}: unknown backend {backend!r}; expected one of {list(known)}.")


def _autocast_off(like: Tensor):
    device_type = like.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _gradient_like(tensor: Tensor | None) -> Tensor:
    """The layout every gradient has, real or fake: ``empty_like`` of its input (a placeholder for None)."""
    if tensor is None:
        return torch.empty(PLACEHOLDER_SHAPE)
    return torch.empty_like(tensor)


def _as_gradient(grad: Tensor | None, tensor: Tensor | None) -> Tensor:
    """A path's gradient in its input's dtype and in ``empty_like(input)``'s layout, as the fake promises."""
    if tensor is None:
        return torch.empty(PLACEHOLDER_SHAPE)
    like = torch.empty_like(tensor)
    if grad is None:  # not needed by autograd: any values do
        return like.zero_()
    if grad.dtype == like.dtype and grad.shape == like.shape and grad.stride() == like.stride():
        return grad
    return like.copy_(grad.reshape(like.shape))
