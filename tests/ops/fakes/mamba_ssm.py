"""A stand-in for mamba-ssm's SSD module (``mamba_ssm.ops.triton.ssd_combined``, mamba-ssm 2.3.2.post1): the two
functions compilepack's mamba_ssm path calls, with mamba-ssm's argument names (a renamed or extra argument fails
here with a TypeError), each call recorded.

Results come from compilepack's reference path, so the path's wiring is tested, not mamba-ssm's numerics.

The int32 offsets of every release (mamba #1015, #1036) are the contract: a call whose input, chunk states or
chunk matrices (and their gradients, the head split at its widest) reach ``INT32_ELEMENTS`` elements raises
``OverflowError`` (on the GPU a silent wrap or an illegal access). A test lowers the class attribute to reach it."""

from __future__ import annotations

import types

import torch

from compilepack.ops.mamba2 import reference


def _kernel_tensor(t: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> None:
    assert t.is_contiguous(), f"{name} must be contiguous: the Triton kernels assume stride(-1) == 1"
    if dtype is not None:
        assert t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}"


class FakeSSD(types.SimpleNamespace):
    """``mamba_ssm.ops.triton.ssd_combined``: ``mamba_chunk_scan_combined`` and ``_mamba_chunk_scan_combined_bwd``."""

    INT32_ELEMENTS = 2**31

    def __init__(self):
        super().__init__(calls=[])

    def check_offsets(self, x, B, chunk_size):
        """The tensors the library allocates and indexes: x ``[b, T, H, P]``, the chunk states ``[b, nc, H, P, N]``,
        the chunk matrices' gradient ``[b, nc, H/G, G, cs, cs]`` and dB ``[b, T, H/G, G, N]``, T in whole chunks."""
        batch, seqlen, heads, head_dim = x.shape
        chunks = -(-seqlen // chunk_size)
        sizes = {"x": batch * chunks * chunk_size * heads * head_dim,
                 "states": batch * chunks * heads * head_dim * B.shape[3],
                 "dcb": batch * chunks * heads * chunk_size * chunk_size,
                 "dB": batch * chunks * chunk_size * heads * B.shape[3]}
        name, largest = max(sizes.items(), key=lambda item: item[1])
        if largest >= self.INT32_ELEMENTS:
            raise OverflowError(f"{name} has {largest} elements: mamba-ssm's int32 offsets wrap (mamba #1015, #1036)")

    def check_scan(self, x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx, dt_softplus, dt_limit):
        self.check_offsets(x, B, chunk_size)
        for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias)):
            if t is not None:
                _kernel_tensor(t, name)
                assert t.device == x.device, f"{name} on another device than x"
        _kernel_tensor(seq_idx, "seq_idx", torch.int32)
        assert seq_idx.shape == x.shape[:2], "seq_idx must be [b, T]"
        assert type(chunk_size) is int and type(dt_softplus) is bool
        assert isinstance(dt_limit, tuple) and all(type(v) is float for v in dt_limit)

    def mamba_chunk_scan_combined(self, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                  initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                                  dt_limit=(0.0, float("inf")), return_final_states=False,
                                  return_varlen_states=False):
        self.calls.append("scan_forward")
        self.check_scan(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx, dt_softplus, dt_limit)
        assert z is None and initial_states is None and cu_seqlens is None
        assert not return_final_states and not return_varlen_states
        y, _ = reference.forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, *dt_limit)
        return y.to(x.dtype)  # the kernel allocates its output as x.dtype

    def _mamba_chunk_scan_combined_bwd(self, dout, x, dt, A, B, C, out, chunk_size, D=None, z=None, dt_bias=None,
                                       initial_states=None, dfinal_states=None, seq_idx=None, dt_softplus=False,
                                       dt_limit=(0.0, float("inf"))):
        self.calls.append("scan_backward")
        self.check_scan(x, dt, A, B, C, chunk_size, D, dt_bias, seq_idx, dt_softplus, dt_limit)
        _kernel_tensor(dout, "dout", x.dtype)
        assert z is None and initial_states is None and dfinal_states is None
        assert out.shape == x.shape and out.dtype == x.dtype, "out must be the forward's output"
        y, saved = reference.forward(x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size, dt_softplus, *dt_limit)
        torch.testing.assert_close(out, y.to(x.dtype), msg="out must be the forward's output")
        grads = reference.backward(dout, y, saved, [True] * 7, x, dt, A, B, C, seq_idx, D, dt_bias, chunk_size,
                                   dt_softplus, *dt_limit)
        dx, ddt, dA, dB, dC, dD, ddt_bias = grads
        ddt_bias = None if ddt_bias is None else ddt_bias.float()
        return dx, ddt, dA.float(), dB, dC, dD, None, ddt_bias, None
