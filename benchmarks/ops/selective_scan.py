"""Benchmark helper: stock transformers ``mamba_selective_scan`` vs ``compilepack::selective_scan_varlen``.

Sizes of one small Mamba1 layer (hidden 256, expand 2): D = 512 channels, state N = 16, one packed row (b = 1),
laid out as transformers' ``MambaMixer`` passes them (u, z, B, C are transposes of ``[b, T, ...]``
projections). ``delta``, ``delta_bias`` and ``A`` are made as the model initialises them (softplus-ed dt in
[0.001, 0.1], ``A = -[1..N]``). The stock function (the torch fallback behind ``mamba_selective_scan`` when
mamba-ssm is absent: one Python step per token) runs on the packed row without boundaries (wrong, but the cost
baseline). Its backward is slow: each token's ``discrete_A[:, :, t]`` / ``deltaB_u[:, :, t]`` read puts a
full-size zero-filled gradient buffer into autograd, so one stock forward+backward at T=2048 takes 1.5-3.5
minutes on 2 CPU cores (measured); time this op with few repeats (``python -m benchmarks ops --ops
selective_scan --repeats 3 --warmup 1``).
"""

from __future__ import annotations

import math

import torch

from ._common import as_rows, doc_lengths_of, equal_lengths_case, seq_idx_of

NAME = "selective_scan"


def setup(
    T: int = 2048, n_docs: int = 16, device: str = "cpu", seed: int = 0, *, dim: int = 512, state_size: int = 16,
    equal_lengths: bool = False,
) -> dict:
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    from compilepack.ops.selective_scan import selective_scan_varlen

    generator = torch.Generator().manual_seed(seed)
    seq_idx = seq_idx_of(doc_lengths_of(T, n_docs, generator, equal_lengths), device)
    channel_last = lambda rows: torch.randn(1, T, rows, generator=generator).transpose(1, 2)  # noqa: E731
    u, z = channel_last(dim), channel_last(dim)
    B, C = channel_last(state_size), channel_last(state_size)
    delta = torch.randn(1, dim, T, generator=generator) * 0.1
    dt = torch.exp(torch.rand(dim, generator=generator) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    delta_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus, as MambaMixer initialises dt_proj.bias
    A = -torch.arange(1, state_size + 1, dtype=torch.float32).expand(dim, -1).contiguous()
    D = torch.ones(dim)
    inputs = [t.to(device).requires_grad_() for t in (u, delta, A, B, C, D, z, delta_bias)]

    def stock(rows: int | None = None):
        u, delta, A, B, C, D, z, delta_bias = inputs
        if rows:  # every [1, channels, T] input as [rows, channels, L]
            u, delta, B, C, z = (as_rows(t, rows, 2) for t in (u, delta, B, C, z))
        return mamba_selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=True)

    def packed():
        u, delta, A, B, C, D, z, delta_bias = inputs
        return selective_scan_varlen(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=True,
                                     seq_idx=seq_idx)

    case = {"stock": stock, "packed": packed, "inputs": inputs,
            "batched_as_packed": lambda out: out.movedim(0, 1).flatten(1)[None]}
    return equal_lengths_case(case, lambda: stock(n_docs), equal_lengths)
