"""Benchmark helper: stock transformers ``mamba2_chunk_scan`` vs ``compilepack::mamba2_chunk_scan_varlen``.

Sizes of one small Bamba-style Mamba2 layer (hidden 256, expand 2): 8 heads of width 64 (512 channels), one
B/C group, state 64, chunk 256 (Bamba's default; 64 is measured too), one packed row (b = 1). dt, A, D and
dt_bias are made as the model makes them (softplus-ed dt around 0.1, A = -exp(A_log) in [-8, -1]). The stock
function runs on the packed row without boundaries (wrong, but the cost baseline).
"""

from __future__ import annotations

import torch

from ._common import as_rows, doc_lengths_of, equal_lengths_case, seq_idx_of

NAME = "mamba2"


def _backend(device: str) -> str:
    return "mamba_ssm" if device.startswith("cuda") else "reference"


def setup(
    T: int = 2048, n_docs: int = 16, device: str = "cpu", seed: int = 0, *, chunk_size: int = 256, heads: int = 8,
    head_dim: int = 64, groups: int = 1, state_size: int = 64, equal_lengths: bool = False,
) -> dict:
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    from compilepack.ops.mamba2 import mamba2_chunk_scan_varlen

    generator = torch.Generator().manual_seed(seed)
    seq_idx = seq_idx_of(doc_lengths_of(T, n_docs, generator, equal_lengths), device)
    x = torch.randn(1, T, heads, head_dim, generator=generator)
    dt = torch.randn(1, T, heads, generator=generator) - 2.0
    A = -torch.empty(heads).uniform_(1.0, 8.0, generator=generator)
    B = torch.randn(1, T, groups, state_size, generator=generator)
    C = torch.randn(1, T, groups, state_size, generator=generator)
    D = torch.ones(heads)
    dt_bias = torch.rand(heads, generator=generator)
    inputs = [t.to(device).requires_grad_() for t in (x, dt, A, B, C, D, dt_bias)]
    backend = _backend(device)

    def stock(rows: int | None = None):
        x, dt, A, B, C, D, dt_bias = inputs
        if rows:
            x, dt, B, C = (as_rows(t, rows, 1) for t in (x, dt, B, C))
        return mamba2_chunk_scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True)

    def packed():
        x, dt, A, B, C, D, dt_bias = inputs
        return mamba2_chunk_scan_varlen(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True,
                                        seq_idx=seq_idx, backend=backend)

    case = {"stock": stock, "packed": packed, "inputs": inputs}
    return equal_lengths_case(case, lambda: stock(n_docs), equal_lengths)
