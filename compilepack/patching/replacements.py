"""What compilepack puts in place of transformers' kernel-calling module globals.

Each :class:`Replacement` names one global that stock forwards call (``causal_conv1d_fn``, ...), the parameters
the stock function must have (checked at ``patch()`` time against the installed transformers), and a factory
that builds compilepack's version from the stock object, the chosen backends and the context-parallel group.

Every replacement keeps stock behaviour for batches without boundaries (padded batches, generation with a
cache) and switches to compilepack's boundary-aware op when the batch carries them: it reads the boundaries the
patched decoder built, one :class:`~compilepack.batch.derived.PackedBoundaries` under one key, and takes the one
branch :func:`_dispatch` writes (stock, op, or its context-parallel form). The switch tests only whether that value
is present: a static fact, so it adds no guard that changes between batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch

from ..batch import rules
from ..ops.backends import Backends
from ..batch.derived import PackedBoundaries
from ..batch.keys import CACHE_KEYS, PACKED_BOUNDARIES
from ..distributed.sharding import check_batch
from ..errors import BoundaryError
from ..ops import (
    causal_conv1d_varlen,
    gated_delta_rule_varlen,
    kimi_delta_attention_varlen,
    mamba2_chunk_scan_varlen,
    selective_scan_varlen,
    varlen_attention,
)
from ..ops.attention.sharded import varlen_attention_sharded
from ..ops.causal_conv1d.sharded import causal_conv1d_sharded
from ..ops.gated_delta_rule.sharded import gated_delta_rule_sharded
from ..ops.kimi_delta_attention.sharded import kimi_delta_attention_sharded
from ..ops.mamba2.sharded import mamba2_chunk_scan_sharded


@dataclasses.dataclass(frozen=True)
class Replacement:
    """A transformers module global that compilepack swaps inside patched forwards."""

    global_name: str
    # (the stock object, the backends, the model's ContextParallel or None) -> compilepack's object
    make: Callable[[object, Backends, object], object]
    # the stock function must accept these; an entry may be a tuple of names a release may use instead of each
    # other (empty: not a function)
    expected_params: tuple[str | tuple[str, ...], ...] = ()
    # what runs on CUDA in its place when the kernel library is installed, for docs/models.md ("": nothing to say)
    kernels: str = ""
    # whether its packed path runs sharded under context parallelism (patch(model, context_parallel=...) refuses
    # models that call a replacement without it)
    runs_sharded: bool = False
    # stock module functions that newer releases put between a layer's forward and this global (transformers 5.25:
    # the layer calls ``causal_conv1d_forward(conv1d, x, cache, ...)``, which calls ``causal_conv1d_fn``): a layer
    # whose forward loads one of them instead of ``global_name`` gets a copy of that function rebound (builder.py)
    via: tuple[str, ...] = ()
    # a fused kernel a release may drop (transformers 5.25's FalconMamba has no ``mamba_inner_fn`` path): a forward
    # that no longer loads it has nothing to replace
    optional: bool = False
    # the ops whose CUDA backend it runs (``Backends`` keys): patch() resolves and checks only the ops a family's
    # replacements name, so no model is refused for a kernel library it would never call
    ops: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------------ the one branch

Result = TypeVar("Result")


def _boundaries(kwargs: dict, seq_idx=None) -> PackedBoundaries | None:
    """The batch's boundaries as the patched decoder built them (None: a batch without boundaries). A kernel call
    handed ``seq_idx`` but not the forward's ``**kwargs`` (LFM2's conv in transformers 5.18) knows them by
    ``seq_idx`` alone."""
    boundaries = kwargs.get(PACKED_BOUNDARIES)
    if boundaries is None and seq_idx is not None:
        return PackedBoundaries.of_seq_idx(seq_idx)
    return boundaries


def _dispatch(
    boundaries: PackedBoundaries | None, cp, where: str, *, stock: Callable[[], Result],
    op: Callable[[PackedBoundaries], Result], sharded: Callable[[PackedBoundaries], Result] | None = None,
    refuse: Callable[[], None] = lambda: None,
) -> Result:
    """The branch every replacement takes, on static facts only: ``stock()`` for a batch without boundaries; else,
    once ``refuse()`` has refused what a packed batch cannot do, compilepack's ``op``, or under context parallelism
    (``cp``, the model's group, fixed at patch() time) its ``sharded`` form, once the batch is known to be sharded
    for that group (an identity check: a guard in a graph). A model patched without ``cp`` never enters
    compilepack/distributed here."""
    if boundaries is None:
        return stock()
    refuse()
    if cp is None:
        return op(boundaries)
    check_batch(boundaries.shard, cp, where)
    return sharded(boundaries)


# ------------------------------------------------------------------------------------------------ attention


class PackedAttentionFunctions:
    """Stands in for ``ALL_ATTENTION_FUNCTIONS`` inside patched attention forwards.

    ``get_interface`` resolves the configured implementation exactly as stock does, then wraps it: packed
    batches go to ``compilepack::varlen_attention``, everything else to the stock function.
    """

    def __init__(self, stock, backend: str, cp=None):
        self._stock = stock
        self._backend = backend
        self._cp = cp  # the ContextParallel group, or None

    def get_interface(self, attn_implementation, default):
        stock_attention = self._stock.get_interface(attn_implementation, default)
        return functools.partial(
            packed_attention, stock_attention=stock_attention, backend=self._backend, cp=self._cp,
        )

    def __getitem__(self, attn_implementation):
        return self.get_interface(attn_implementation, None)


def packed_attention(
    module, query, key, value, attention_mask, *, stock_attention, backend, cp=None, **kwargs
):
    """transformers attention-interface function: ``[B, H, T, D]`` inputs, returns ``([B, T, H, Dv], None)``.

    Only a packed batch (one whose boundaries the patched decoder built: a static fact) runs compilepack's op; every
    other call (padded, unpadded, cached decoding) is the stock function's, with its dropout and attention weights.
    Under context parallelism the op runs head-parallel over the whole rows, over tokens against the gathered keys,
    or both (``ops/attention/sharded.py``)."""
    where = type(module).__name__
    rows, heads, row_length, _ = query.shape

    def options(boundaries: PackedBoundaries) -> dict:
        return dict(
            causal=getattr(module, "is_causal", True), scale=kwargs.get("scaling"), window=kwargs.get("sliding_window"),
            cu_seqlens_cpu=boundaries.cu_seqlens_cpu, backend=backend,
        )

    def single(b: PackedBoundaries):
        q, k, v = (_tokens_first(x) for x in _autocast_dtype(query, key, value))
        out = varlen_attention(q, k, v, b.cu_seqlens, b.max_seqlen, **options(b))
        return out.view(rows, row_length, heads, -1), None

    def sharded(b: PackedBoundaries):  # head-parallel over the whole rows, or over tokens (the group's mode)
        out = varlen_attention_sharded(
            *_autocast_dtype(query, key, value), b.cu_seqlens, b.max_seqlen, global_length=b.seq_idx.shape[-1],
            cp=cp, where=where, **options(b),
        )
        return out, None

    return _dispatch(
        _boundaries(kwargs), cp, where, op=single, sharded=sharded,
        stock=lambda: stock_attention(module, query, key, value, attention_mask, **kwargs),
        refuse=lambda: _refuse_unsupported_attention(module, kwargs),
    )


def _autocast_dtype(*tensors):
    """Under autocast, q/k/v in the autocast dtype, as autocast does for SDPA. The custom op is opaque to
    autocast, and RoPE promotes q and k to fp32 while v stays in the low-precision dtype."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


def _tokens_first(x_BHTD: torch.Tensor) -> torch.Tensor:
    rows, heads, length, dim = x_BHTD.shape
    return x_BHTD.transpose(1, 2).reshape(rows * length, heads, dim)


def _refuse_unsupported_attention(module, kwargs) -> None:
    """What a packed batch cannot do that stock attention can: refused, never silently dropped."""
    name = type(module).__name__
    if kwargs.get("dropout", 0.0):
        rules.refuse(NotImplementedError, (
            f"{name}: attention dropout ({kwargs['dropout']}) is not supported on packed batches (batches without "
            "boundary kwargs run stock attention, dropout included); set config.attention_dropout = 0.0 to train "
            "packed."
        ))
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        rules.refuse(NotImplementedError, (
            f"{name}: output_attentions=True is not supported on packed batches (compilepack's attention op returns "
            "no weights); run the batch unpacked, without boundary kwargs, to get attention weights."
        ))
    if kwargs.get("softcap") is not None:
        rules.refuse(NotImplementedError, f"{name}: attention logit softcapping is not supported yet.")


ATTENTION = Replacement(
    "ALL_ATTENTION_FUNCTIONS", lambda stock, b, cp: PackedAttentionFunctions(stock, b["varlen_attention"], cp),
    kernels="attention: flash-attn varlen, else torch varlen_attn (CPU: per-document flash kernel)",
    runs_sharded=True, ops=("varlen_attention",),
)


# ------------------------------------------------------------------------------------------------ masks


def _make_mask_creator(stock: Callable, backends: Backends, cp) -> Callable:
    def create_mask(config, inputs_embeds, attention_mask, cache=None, position_ids=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop(CACHE_KEYS[1], None)
        if attention_mask is None and cache is None:
            # Stock would read documents off position_ids here (a data-dependent check and a dense T x T
            # mask). Packed batches carry boundaries and plain rows are causal: no mask is needed.
            return None
        return stock(config, inputs_embeds, attention_mask, cache, position_ids, **kwargs)

    return create_mask


# the cache argument is ``past_key_values`` up to transformers 5.23 and ``cache`` from 5.24; passed positionally
_MASK_PARAMS = ("config", "inputs_embeds", "attention_mask", CACHE_KEYS, "position_ids")
CAUSAL_MASK = Replacement("create_causal_mask", _make_mask_creator, _MASK_PARAMS)
SLIDING_WINDOW_MASK = Replacement("create_sliding_window_causal_mask", _make_mask_creator, _MASK_PARAMS)
MASK_CREATORS = (CAUSAL_MASK, SLIDING_WINDOW_MASK)


# ------------------------------------------------------------------------------------------------ causal conv1d


def _make_causal_conv1d(stock: Callable, backends: Backends, cp) -> Callable:
    backend = backends["causal_conv1d_varlen"]  # like cp, fixed at patch() time

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        args = (hidden_states, weight, bias)
        return _dispatch(
            _boundaries(kwargs, seq_idx), cp, "causal conv1d",
            stock=lambda: stock(*args, activation=activation),
            op=lambda b: causal_conv1d_varlen(*args, b.seq_idx, activation, backend=backend),
            # channel-parallel over the whole rows, or over tokens (a halo)
            sharded=lambda b: causal_conv1d_sharded(*args, b.seq_idx, activation, backend=backend, cp=cp),
        )

    return causal_conv1d_fn


CAUSAL_CONV1D = Replacement(
    "causal_conv1d_fn", _make_causal_conv1d, ("hidden_states", "weight", "bias", "activation"),
    kernels="conv: causal-conv1d causal_conv1d_fn(seq_idx)", runs_sharded=True, via=("causal_conv1d_forward",),
    ops=("causal_conv1d_varlen",),
)


# ------------------------------------------------------------------------------------------------ gated delta rule


def _delta_rule(
    global_name: str, varlen: Callable, sharded: Callable, what: str, stock_takes_kwargs: bool, kernels: str,
    op: str,
) -> Replacement:
    """transformers' chunked delta rule ``global_name`` (``query, key, value, g, beta`` and its chunk, state and
    l2norm arguments): the stock function for batches without boundaries, compilepack's op ``varlen`` for packed
    ones, or its ``sharded`` form under context parallelism. ``stock_takes_kwargs``: the other keywords go to the
    stock function too. ``op``: the compilepack op ``varlen`` calls, whose backend it runs."""

    def make(stock: Callable, backends: Backends, cp) -> Callable:

        def chunk_delta_rule(
            query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, **kwargs,
        ):
            args = (query, key, value, g, beta)

            def options(b: PackedBoundaries) -> dict:
                return dict(use_qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens_cpu=b.cu_seqlens_cpu,
                            backend=backends[op])

            return _dispatch(
                _boundaries(kwargs), cp, what,
                stock=lambda: stock(
                    *args[:3], g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    **(kwargs if stock_takes_kwargs else {}),
                ),
                refuse=lambda: _refuse_state(initial_state is not None or output_final_state, what),
                op=lambda b: (varlen(*args, b.cu_seqlens, **options(b)), None),
                # head-parallel over the whole rows, or over tokens (a state pass)
                sharded=lambda b: (sharded(*args, b.cu_seqlens, cp=cp, where=what, **options(b)), None),
            )

        chunk_delta_rule.__name__ = chunk_delta_rule.__qualname__ = global_name
        return chunk_delta_rule

    expected = ("query", "key", "value", "g", "beta", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
    return Replacement(global_name, make, expected, kernels, runs_sharded=True, ops=(op,))


# Gated DeltaNet's delta rule (its layers also pass the boundaries as ``cu_seqlens``, for stock).
GATED_DELTA_RULE = _delta_rule(
    "torch_chunk_gated_delta_rule", gated_delta_rule_varlen, gated_delta_rule_sharded, "gated delta rule",
    stock_takes_kwargs=False, kernels="delta rule: fla chunk_gated_delta_rule(cu_seqlens)",
    op="gated_delta_rule_varlen",
)
# The KDA kernel of Kimi Linear, given the layer's kwargs.
KIMI_DELTA_ATTENTION = _delta_rule(
    "chunk_kimi_delta_attention", kimi_delta_attention_varlen, kimi_delta_attention_sharded,
    "Kimi delta attention", stock_takes_kwargs=True, kernels="KDA: fla chunk_kda(cu_seqlens)",
    op="kimi_delta_attention_varlen",
)


# ------------------------------------------------------------------------------------------------ Mamba2 scan


def _make_mamba2_chunk_scan(stock: Callable, backends: Backends, cp) -> Callable:

    def mamba2_chunk_scan(
        hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
        dt_limit=(0.0, math.inf), return_final_states=False, seq_idx=None, z=None, **kwargs,
    ):
        args = (hidden_states, dt, A, B, C, chunk_size)
        options = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus)
        packed = dict(options, dt_limit=tuple(dt_limit), backend=backends["mamba2_chunk_scan_varlen"])

        def refuse():
            _refuse_state(initial_states is not None or return_final_states, "Mamba2 scan")
            if z is not None:
                rules.refuse(NotImplementedError,
                             "mamba2_chunk_scan with a gate z is not supported on packed batches yet.")

        return _dispatch(
            _boundaries(kwargs, seq_idx), cp, "Mamba2 scan", refuse=refuse,
            stock=lambda: stock(*args, initial_states=initial_states, dt_limit=dt_limit,
                                return_final_states=return_final_states, z=z, **options),
            op=lambda b: mamba2_chunk_scan_varlen(*args, seq_idx=b.seq_idx, **packed),
            # head-parallel over the whole rows, or over tokens (a state pass)
            sharded=lambda b: mamba2_chunk_scan_sharded(*args, seq_idx=b.seq_idx, cp=cp, **packed),
        )

    return mamba2_chunk_scan


MAMBA2_CHUNK_SCAN = Replacement(
    "mamba2_chunk_scan",
    _make_mamba2_chunk_scan,
    ("hidden_states", "dt", "A", "B", "C", "chunk_size", "D", "dt_bias", "initial_states", "dt_softplus", "dt_limit"),
    kernels="scan: mamba-ssm mamba_chunk_scan_combined(seq_idx)", runs_sharded=True, via=("mamba2_scan_forward",),
    ops=("mamba2_chunk_scan_varlen",),
)


def _unfused_when_packed(global_name: str, expected_params: tuple[str, ...], runs_sharded: bool) -> Replacement:
    """A fused mixer kernel's global: the stock kernel for batches without boundaries; for a packed batch None,
    which is how the stock forward asks for its unfused path, whose conv and scan are compilepack's ops. Decided
    from static facts only (whether the boundaries are passed)."""

    def make(stock: Callable, backends: Backends, cp) -> Callable:
        def unfused_when_packed(first, *args, seq_idx=None, **kwargs):
            if _boundaries(kwargs, seq_idx) is None:
                return stock(first, *args, **kwargs)
            return None

        unfused_when_packed.__name__ = unfused_when_packed.__qualname__ = global_name
        return unfused_when_packed

    return Replacement(global_name, make, expected_params, kernels=f"fused {global_name}: never on packed batches",
                       runs_sharded=runs_sharded, optional=True)


# A packed batch always takes the mixer's unfused path, its conv and scan each on their CUDA kernel when
# installed. The fused kernel is handed raw weights (``out_proj.weight``, the norm's weight), so it would silently
# bypass adapters such as LoRA on those modules, and the replacement never sees the modules to tell.
MAMBA2_SPLIT_CONV1D_SCAN = _unfused_when_packed(
    "mamba2_split_conv1d_scan_combined", ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "chunk_size"),
    runs_sharded=True,
)


# ------------------------------------------------------------------------------------------------ Mamba1 scan


def _make_selective_scan(stock: Callable, backends: Backends, cp) -> Callable:
    def mamba_selective_scan(
        hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
        return_last_state=False, use_mambapy=False, use_associative_scan=False, seq_idx=None, **kwargs,
    ):
        args = (hidden_states, dt, A, B, C)
        options = dict(D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
        return _dispatch(  # no context-parallel form: patch(context_parallel=...) refuses the models that call it
            _boundaries(kwargs, seq_idx), None, "selective scan",
            stock=lambda: stock(*args, return_last_state=return_last_state, use_mambapy=use_mambapy,
                                use_associative_scan=use_associative_scan, **options),
            refuse=lambda: _refuse_state(return_last_state, "selective scan"),
            op=lambda b: selective_scan_varlen(*args, seq_idx=b.seq_idx, backend=backends["selective_scan_varlen"],
                                               **options),
        )

    return mamba_selective_scan


# Mamba, FalconMamba and Jamba's scan. Their stacks never hand it the boundaries (transformers 5.24): the families
# thread them there (``Family.boundary_calls``).
SELECTIVE_SCAN = Replacement(
    "mamba_selective_scan",
    _make_selective_scan,
    ("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state"),
    kernels="selective scan: compilepack's reference on every device (mamba-ssm's selective scan cannot reset "
            "inside a row)",
    via=("mamba_scan_forward",), ops=("selective_scan_varlen",),
)


# No fused Mamba1 kernel resets at document starts (mamba-ssm 2.3.2.post1's MambaInnerFn takes no seq_idx), on any
# device: a packed batch always takes the mixer's unfused path.
MAMBA_INNER = _unfused_when_packed(
    "mamba_inner_fn",
    ("xz", "conv1d_weight", "conv1d_bias", "x_proj_weight", "delta_proj_weight", "out_proj_weight", "A"),
    runs_sharded=False,
)


def _refuse_state(carries_state: bool, what: str) -> None:
    if carries_state:
        rules.refuse(BoundaryError, (
            f"{what}: a packed batch cannot start from or return a recurrent state (a cache); packed forwards "
            "run with use_cache=False."
        ))


# ------------------------------------------------------------------------------------------------ mixer kinds

# What one mixer layer of each kind calls, for family files: {"Qwen3NextGatedDeltaNet": GATED_DELTANET}.
GATED_DELTANET = (CAUSAL_CONV1D, GATED_DELTA_RULE)
KIMI_DELTA_MIXER = (CAUSAL_CONV1D, KIMI_DELTA_ATTENTION)
MAMBA2_MIXER = (CAUSAL_CONV1D, MAMBA2_CHUNK_SCAN, MAMBA2_SPLIT_CONV1D_SCAN)
MAMBA1_MIXER = (CAUSAL_CONV1D, SELECTIVE_SCAN)  # Jamba's mixer has no fused path
MAMBA1_FUSED_MIXER = (*MAMBA1_MIXER, MAMBA_INNER)  # Mamba's and FalconMamba's
