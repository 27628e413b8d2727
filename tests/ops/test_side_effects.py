"""No op and no tool changes process-wide state during a call: the thread count (a process-wide setting another
thread's work would run under) and dynamo's caches (the user's other compiled code)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

import compilepack
from compilepack import ops
from tests.families import build_tiny
from tests.models import hf_batch, random_docs
from tests.strategies import cu_seqlens_of, seq_idx_of

LENGTHS = [9, 1, 30]
T = sum(LENGTHS)


def _inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g).requires_grad_()  # noqa: E731
    cu, seq_idx = cu_seqlens_of(LENGTHS), seq_idx_of(LENGTHS)
    decay = lambda *shape: F.logsigmoid(torch.randn(*shape, generator=g)).requires_grad_()  # noqa: E731
    return {
        "attention": lambda: ops.varlen_attention(r(T, 2, 8), r(T, 2, 8), r(T, 2, 8), cu, T),
        "conv": lambda: ops.causal_conv1d_varlen(r(1, 8, T), r(8, 4), r(8), seq_idx, "silu"),
        "gated_delta_rule": lambda: ops.gated_delta_rule_varlen(r(1, T, 2, 8), r(1, T, 2, 8), r(1, T, 2, 8),
                                                                decay(1, T, 2), r(1, T, 2).sigmoid(), cu),
        "kimi_delta_attention": lambda: ops.kimi_delta_attention_varlen(r(1, T, 2, 8), r(1, T, 2, 8), r(1, T, 2, 8),
                                                                        decay(1, T, 2, 8), r(1, T, 2).sigmoid(), cu),
        "mamba2": lambda: ops.mamba2_chunk_scan_varlen(r(1, T, 2, 4), r(1, T, 2), -torch.rand(2), r(1, T, 1, 4),
                                                       r(1, T, 1, 4), 16, seq_idx=seq_idx),
        "selective_scan": lambda: ops.selective_scan_varlen(r(1, 4, T), r(1, 4, T), -torch.rand(4, 3), r(1, 3, T),
                                                            r(1, 3, T), seq_idx=seq_idx),
        "lm_head": lambda: ops.lm_head.lm_head_logprobs(r(T, 8), r(32, 8), None, torch.arange(T) % 32,
                                                       chunk_tokens=16).log_probs,
    }


@pytest.mark.parametrize("op", list(_inputs()))
def test_ops_leave_the_thread_count_alone(op, monkeypatch):
    def refuse(*args):
        raise AssertionError(f"{op} called torch.set_num_threads{args}: a process-wide change")

    monkeypatch.setattr(torch, "set_num_threads", refuse)
    out = _inputs()[op]()
    out.float().square().sum().backward()


def test_explain_and_count_compiles_keep_other_compiled_code():
    counter = torch._dynamo.testing.CompileCounter()
    other = torch.compile(lambda x: x.sin() + 1, backend=counter)
    other(torch.ones(3))
    model = compilepack.patch(build_tiny(compilepack.patching.family_named("llama")).eval())
    batch = hf_batch(random_docs(model.config.vocab_size, [5, 3]))
    compilepack.explain(model, batch)
    compilepack.count_compiles(model, [batch])
    other(torch.ones(3))
    assert counter.frame_count == 1  # the user's compiled function was not thrown away and compiled again
