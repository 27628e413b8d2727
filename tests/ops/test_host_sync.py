"""No op reads a boundary tensor that would live on the GPU back to the host (a device-to-host sync per call), and
every kernel call that accepts the host copy of the boundaries gets it.

On CPU a sync cannot be observed, so the boundary tensors are stand-ins for device tensors: reading one on the host
(``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()``) raises. The host copy
(``cu_seqlens_cpu``) is a plain CPU tensor, as the collator hands it over. Each op runs forward and backward on its
reference path and on each kernel path (through the recording fakes of tests/ops/fakes). On a GPU the check is
``torch.cuda.set_sync_debug_mode("error")`` around a compiled training step (tools/gpu_check).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compilepack.ops import _scaffold
from compilepack.ops import (
    causal_conv1d_varlen,
    gated_delta_rule_varlen,
    kimi_delta_attention_varlen,
    mamba2_chunk_scan_varlen,
    selective_scan_varlen,
    varlen_attention,
)
from tests.ops.fakes import route_kernels
from tests.ops.fakes.causal_conv1d import MODULES as CONV_MODULES
from tests.ops.fakes.causal_conv1d import FakeCausalConv1d
from tests.ops.fakes.fla import FakeFla
from tests.ops.fakes.flash_attn import FakeFlashAttn
from tests.ops.fakes.mamba_ssm import FakeSSD
from tests.strategies import cu_seqlens_of, seq_idx_of

LENGTHS = [9, 1, 66, 20]
T = sum(LENGTHS)


class OnDevice(torch.Tensor):
    """A boundary tensor standing for one on the GPU: any host read of its values raises."""

    def _host_read(self, *args, **kwargs):
        raise AssertionError("a boundary tensor that lives on the GPU was read on the host (a device-to-host sync)")

    # (``.to(x.device)`` stays allowed: on a GPU it moves nothing, and here it cannot be told from a host read)
    item = tolist = cpu = numpy = __bool__ = _host_read


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(OnDevice)


def test_the_stand_in_refuses_host_reads():
    boundary = on_device(cu_seqlens_of(LENGTHS))
    for read in (lambda: boundary.tolist(), lambda: boundary[1].item(), lambda: bool(boundary[1] > 0),
                 lambda: boundary.cpu()):
        with pytest.raises(AssertionError, match="read on the host"):
            read()
    assert boundary.to(torch.int64).dtype == torch.int64  # device-side work is fine


def _grad_inputs(*shapes, decay=None):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(*shape, generator=g) for shape in shapes]
    if decay is not None:
        tensors[decay] = F.logsigmoid(tensors[decay] + 2)
    return [t.requires_grad_() for t in tensors]


def _forward_backward(out):
    out.float().square().sum().backward()


CU, SEQ_IDX = cu_seqlens_of(LENGTHS), seq_idx_of(LENGTHS)


def _attention(backend):
    q, k, v = _grad_inputs((T, 4, 16), (T, 2, 16), (T, 2, 16))
    return varlen_attention(q, k, v, on_device(CU), max(LENGTHS), cu_seqlens_cpu=CU.clone(), backend=backend)


def _conv(backend):
    x, w, b = _grad_inputs((1, T, 16), (16, 4), (16,))
    return causal_conv1d_varlen(x.transpose(1, 2), w, b, on_device(SEQ_IDX), "silu", backend=backend)


def _gated_delta_rule(backend):
    q, k, v, g, beta = _grad_inputs((1, T, 2, 16), (1, T, 2, 16), (1, T, 4, 8), (1, T, 4), (1, T, 4), decay=3)
    return gated_delta_rule_varlen(q, k, v, g, beta.sigmoid(), on_device(CU), cu_seqlens_cpu=CU.clone(),
                                   backend=backend)


def _kimi_delta_attention(backend):
    q, k, v, g, beta = _grad_inputs((1, T, 2, 16), (1, T, 2, 16), (1, T, 2, 8), (1, T, 2, 16), (1, T, 2), decay=3)
    return kimi_delta_attention_varlen(q, k, v, g, beta.sigmoid(), on_device(CU), use_qk_l2norm=True,
                                       cu_seqlens_cpu=CU.clone(), backend=backend)


def _mamba2(backend):
    x, dt, B, C = _grad_inputs((1, T, 4, 8), (1, T, 4), (1, T, 2, 8), (1, T, 2, 8))
    A = -torch.rand(4).requires_grad_()
    return mamba2_chunk_scan_varlen(x, dt, A, B, C, 64, dt_softplus=True, seq_idx=on_device(SEQ_IDX),
                                    backend=backend)


def _selective_scan(backend):
    u, delta, B, C = _grad_inputs((1, 8, T), (1, 8, T), (1, 4, T), (1, 4, T))
    A = -torch.rand(8, 4).requires_grad_()
    return selective_scan_varlen(u, delta, A, B, C, delta_softplus=True, seq_idx=on_device(SEQ_IDX), backend=backend)


def _lm_head(backend):
    from compilepack.ops.lm_head import lm_head_logprobs

    h, w = _grad_inputs((T, 16), (64, 16))
    targets = torch.where(torch.arange(T) % 5 == 0, -100, torch.arange(T) % 64)  # every fifth target ignored
    out = lm_head_logprobs(h, w, None, on_device(targets), chunk_tokens=32, stats=("entropy", "is_top1"),
                           backend=backend)
    return torch.stack([out.log_probs, out.entropy])


OPS = {
    "attention": _attention, "conv": _conv, "gated_delta_rule": _gated_delta_rule,
    "kimi_delta_attention": _kimi_delta_attention, "mamba2": _mamba2, "selective_scan": _selective_scan,
    "lm_head": _lm_head,
}


@pytest.fixture(autouse=True)
def boundary_check_as_on_a_gpu(monkeypatch):
    """The ops refuse decreasing boundaries by reading them where that is free: on the host (or from the host copy).
    A stand-in is a CPU tensor, so that check would read it; on a GPU the check returns before reading (the meta
    tensor test in test_decreasing_boundaries.py shows it), and so it does here for stand-ins."""
    check = _scaffold.refuse_steps_back

    def as_on_a_gpu(op, argument, boundaries):
        if not isinstance(boundaries, OnDevice):
            check(op, argument, boundaries)

    monkeypatch.setattr(_scaffold, "refuse_steps_back", as_on_a_gpu)


@pytest.mark.parametrize("op", list(OPS))
def test_reference_paths_never_read_device_boundaries(op):
    _forward_backward(OPS[op]("reference"))


def _fakes():
    return {
        "flash_attn": ("attention", {"flash_attn.flash_attn_interface": FakeFlashAttn()}),
        "causal_conv1d": ("conv", dict.fromkeys(CONV_MODULES, FakeCausalConv1d())),
        "fla (gated delta rule)": ("gated_delta_rule", {"fla.ops.gated_delta_rule.chunk": FakeFla(T)}),
        "fla (kda)": ("kimi_delta_attention", {"fla.ops.kda.chunk": FakeFla(T)}),
        "mamba_ssm": ("mamba2", {"mamba_ssm.ops.triton.ssd_combined": FakeSSD()}),
    }


@pytest.mark.parametrize("library", list(_fakes()))
def test_kernel_paths_never_read_device_boundaries_and_get_the_host_copy(library, monkeypatch):
    op, modules = _fakes()[library]
    backend = library.split(" ")[0]
    loaded = route_kernels(monkeypatch, backend, modules)
    _forward_backward(OPS[op](backend))
    assert loaded, f"{library}: the kernel path did not run"
    for fake in modules.values():
        for host in getattr(fake, "host_boundaries", []):
            assert host is not None and not isinstance(host, OnDevice), "fla must be handed the host copy"
            assert torch.equal(host, CU)
