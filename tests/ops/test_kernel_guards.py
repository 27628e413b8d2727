"""The guards against the kernel libraries' reported varlen bugs (docs/kernels.md), on CPU with recording fakes that
reproduce each bug as the library's contract (tests/ops/fakes).

For every bug that applies to a release compilepack admits: the library alone fails on the input a packed batch
produces; the op's path, guarded, runs it and equals the reference path exactly; and with the guard taken out
(monkeypatched away) the same op call fails. Then the version floors: an installed library below its floor is
refused, naming the version and the fix.
"""

from __future__ import annotations

import tomllib
import types
import warnings
from pathlib import Path

import pytest
import torch

import compilepack
from compilepack import KernelSkippedWarning
from compilepack.ops import backends
from compilepack.patching import family_named
from compilepack.patching.api import patch_state
from compilepack.ops.attention import flash_attn, torch_varlen, varlen_attention
from compilepack.ops.causal_conv1d import causal_conv1d_kernel, causal_conv1d_varlen
from compilepack.ops.mamba2 import mamba2_chunk_scan_varlen, mamba_ssm
from compilepack.ops.mamba2.mamba_ssm import SSD_COMBINED, fits_int32_offsets
from tests.ops.fakes import route_kernels
from tests.ops.fakes.causal_conv1d import MODULES, FakeCausalConv1d
from tests.ops.fakes.flash_attn import FakeFlashAttn
from tests.ops.fakes.mamba_ssm import FakeSSD
from tests.ops.fakes.torch_varlen import FakeTorchVarlen
from tests.families import build_tiny
from tests.strategies import cu_seqlens_of, seq_idx_of

ROOT = Path(__file__).resolve().parents[2]
# the ops whose backends patch() chooses (Backends keys)
ATTENTION, CONV, SSD = "varlen_attention", "causal_conv1d_varlen", "mamba2_chunk_scan_varlen"
GDN, KDA = "gated_delta_rule_varlen", "kimi_delta_attention_varlen"


def _grads(function, inputs):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = function(*inputs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return [out.detach(), *torch.autograd.grad(out, inputs, grad)]


def _assert_equal(got, expected):
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ causal-conv1d


def _conv_inputs(rows: int, length: int, dim: int = 16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, length, dim, generator=g).transpose(1, 2)  # channel-last, as transformers passes it
    return x, torch.randn(dim, 4, generator=g), torch.randn(dim, generator=g)


@pytest.fixture
def conv_kernel(monkeypatch):
    fake = FakeCausalConv1d()
    route_kernels(monkeypatch, "causal_conv1d", dict.fromkeys(MODULES, fake))
    return fake


def _conv(seq_idx, backend):
    return lambda x, weight, bias: causal_conv1d_varlen(x, weight, bias, seq_idx, "silu", backend=backend)


@pytest.mark.parametrize("rows", [1, 2])
def test_causal_conv1d_forward_reads_past_the_seq_idx_of_a_partial_chunk(conv_kernel, rows):
    """causal-conv1d #117: rows of 70 tokens (not a multiple of 64). The library alone, given the seq_idx tensor the
    collator makes, reads past it; the guarded path hands it padded storage and equals the reference exactly."""
    x, weight, bias = _conv_inputs(rows, 70)
    seq_idx = seq_idx_of([30, 1, 39] * rows).view(rows, 70)
    with pytest.raises(IndexError, match="causal-conv1d #117"):
        conv_kernel.causal_conv1d_fn(x, weight, bias, seq_idx, activation="silu")
    conv_kernel.calls.clear()
    guarded = _grads(_conv(seq_idx, "causal_conv1d"), [x, weight, bias])
    assert conv_kernel.calls == ["fwd", "bwd"]
    _assert_equal(guarded, _grads(_conv(seq_idx, backends.REFERENCE), [x, weight, bias]))


def test_causal_conv1d_whole_chunks_read_no_further(conv_kernel):
    """The fake reproduces the bug's condition only: rows of whole 64-token chunks are read in bounds."""
    x, weight, bias = _conv_inputs(2, 128)
    conv_kernel.causal_conv1d_fn(x, weight, bias, seq_idx_of([100, 28, 128]).view(2, 128), activation="silu")


def test_causal_conv1d_without_the_padded_seq_idx_fails(conv_kernel, monkeypatch):
    """Control: the glue's padding taken away, the same call reads out of bounds."""
    monkeypatch.setattr(causal_conv1d_kernel, "SEQ_IDX_CHUNK", 0)
    x, weight, bias = _conv_inputs(1, 70)
    with pytest.raises(IndexError, match="causal-conv1d #117"):
        _conv(seq_idx_of([30, 40]), "causal_conv1d")(x, weight, bias)


def test_causal_conv1d_inputs_past_uint32_offsets_run_the_reference(conv_kernel, monkeypatch):
    """causal-conv1d #114 (uint32 offsets), its limit lowered to this input's size: the library alone overflows; the
    guarded op never calls it and equals the reference; with the glue's limit back at 2**32 the op overflows."""
    x, weight, bias = _conv_inputs(1, 70)
    seq_idx = seq_idx_of([30, 40])
    monkeypatch.setattr(FakeCausalConv1d, "UINT32_ELEMENTS", x.numel())
    with pytest.raises(OverflowError, match="causal-conv1d #114"):
        conv_kernel.causal_conv1d_fn(x, weight, bias, seq_idx, activation="silu")
    conv_kernel.calls.clear()
    monkeypatch.setattr(causal_conv1d_kernel, "UINT32_ELEMENTS", x.numel())
    guarded = _grads(_conv(seq_idx, "causal_conv1d"), [x, weight, bias])
    assert conv_kernel.calls == []
    _assert_equal(guarded, _grads(_conv(seq_idx, backends.REFERENCE), [x, weight, bias]))
    monkeypatch.setattr(causal_conv1d_kernel, "UINT32_ELEMENTS", 2**32)
    with pytest.raises(OverflowError, match="causal-conv1d #114"):
        _conv(seq_idx, "causal_conv1d")(x, weight, bias)


# ------------------------------------------------------------------------------------------------ flash attention

# 1-token and empty documents only, the longest 1 token: what a batch of 1-token samples in fixed-shape slots gives
SHORT_LENGTHS = [1, 0, 1, 1, 0]


def _attention_inputs():
    g = torch.Generator().manual_seed(0)
    total = sum(SHORT_LENGTHS)
    return torch.randn(total, 4, 8, generator=g), torch.randn(total, 2, 8, generator=g), torch.randn(total, 2, 8,
                                                                                                      generator=g)


def _attention(backend, causal):
    cu = cu_seqlens_of(SHORT_LENGTHS)
    return lambda q, k, v: varlen_attention(q, k, v, cu, 1, causal=causal, backend=backend)


def _route_attention(monkeypatch, backend):
    if backend == "flash_attn":
        fake = FakeFlashAttn()
        route_kernels(monkeypatch, "flash_attn", {flash_attn.FLASH_MODULE: fake})
        return fake, fake._flash_attn_varlen_forward
    fake = FakeTorchVarlen.route(monkeypatch)
    return fake, fake._varlen_attn


# the calls that reach the shortcut: compilepack passes a causal call's window as (-1, 0) to both libraries, so only a
# bidirectional one
SHORTCUT_CASES = [("flash_attn", False), ("torch_varlen", False)]


def _call_alone(backend, forward, q, k, v, causal):
    cu = cu_seqlens_of(SHORT_LENGTHS)
    if backend == "flash_attn":
        return forward(q, k, v, cu, cu, 1, 1, 0.0, 0.35, causal, -1, 0 if causal else -1)
    return forward(q, k, v, cu, cu, 1, 1, causal, 0.35, [-1, -1], True)


@pytest.mark.parametrize(("backend", "causal"), SHORTCUT_CASES)
def test_flash_kernels_fail_on_empty_sequences_at_max_seqlen_one(monkeypatch, backend, causal):
    """flash-attn #1537: max_seqlen 1, GQA, no window and an empty sequence. The library alone raises (its
    one-token-per-sequence reshape); the guarded path hands it a bound of 2 and equals the reference exactly."""
    fake, forward = _route_attention(monkeypatch, backend)
    q, k, v = _attention_inputs()
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        _call_alone(backend, forward, q, k, v, causal)
    fake.calls.clear()
    guarded = _grads(_attention(backend, causal), [q, k, v])
    assert fake.calls == ["forward", "backward"]
    _assert_equal(guarded, _grads(_attention(backends.REFERENCE, causal), [q, k, v]))


@pytest.mark.parametrize(("backend", "causal"), SHORTCUT_CASES)
def test_flash_kernels_without_the_bound_guard_fail(monkeypatch, backend, causal):
    """Control: with the bound handed over unchanged the op reaches the shortcut and raises."""
    _route_attention(monkeypatch, backend)
    monkeypatch.setattr(flash_attn, "kernel_max_seqlen", int)
    monkeypatch.setattr(torch_varlen, "kernel_max_seqlen", int)
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        _attention(backend, causal)(*_attention_inputs())


# ------------------------------------------------------------------------------------------------ mamba-ssm


def _scan_inputs(lengths):
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    x, dt = torch.randn(1, total, 4, 16, generator=g), torch.randn(1, total, 4, generator=g) * 0.5
    A, B, C = -torch.rand(4, generator=g) - 0.5, torch.randn(1, total, 2, 8, generator=g), torch.randn(
        1, total, 2, 8, generator=g)
    return [x, dt, A, B, C, torch.rand(4, generator=g), torch.rand(4, generator=g) * 0.1]


def _scan(lengths, backend):
    seq_idx = seq_idx_of(lengths)

    def run(x, dt, A, B, C, D, dt_bias):
        return mamba2_chunk_scan_varlen(x, dt, A, B, C, 64, D=D, dt_bias=dt_bias, dt_softplus=True, seq_idx=seq_idx,
                                        backend=backend)

    return run


def test_mamba_ssm_long_rows_run_the_reference(monkeypatch):
    """mamba #1015/#1036 (int32 offsets), the limit lowered to this row's size: the library alone overflows; the
    guarded op never calls it and equals the reference exactly; with the glue's limit back at 2**31 it overflows."""
    fake = FakeSSD()
    route_kernels(monkeypatch, "mamba_ssm", {SSD_COMBINED: fake})
    lengths = [60, 1, 39]
    inputs = _scan_inputs(lengths)
    x, dt, A, B, C, D, dt_bias = inputs
    limit = 128 * 4 * 16  # x rounded up to two chunks of 64 tokens
    monkeypatch.setattr(FakeSSD, "INT32_ELEMENTS", limit)
    with pytest.raises(OverflowError, match="mamba #1015"):
        fake.mamba_chunk_scan_combined(x, dt, A, B, C, 64, D=D, dt_bias=dt_bias, seq_idx=seq_idx_of(lengths),
                                       dt_softplus=True)
    fake.calls.clear()
    monkeypatch.setattr(mamba_ssm, "INT32_ELEMENTS", limit)
    guarded = _grads(_scan(lengths, "mamba_ssm"), inputs)
    assert fake.calls == []
    _assert_equal(guarded, [t.to(guarded[0].dtype) for t in _grads(_scan(lengths, backends.REFERENCE), inputs)])
    monkeypatch.setattr(mamba_ssm, "INT32_ELEMENTS", 2**31)
    with pytest.raises(OverflowError, match="mamba #1015"):
        _scan(lengths, "mamba_ssm")(*inputs)


def _stand_in(shape, device):
    return types.SimpleNamespace(shape=shape, device=torch.device(device))


# Bamba-9B's scan widths: 128 heads of 64, one group of state 128, chunks of 256 tokens
BAMBA_9B = {"heads": 128, "head_dim": 64, "groups": 1, "state": 128, "chunk": 256}


@pytest.mark.parametrize(("device", "longest_row"), [("cuda", 262144 - 256), ("cpu", 65536 - 256)])
def test_int32_bound_at_real_widths(monkeypatch, device, longest_row):
    """On an H200 (132 SMs) a long row splits no heads in the backward, so x ([b, T, H, P], 8192 elements a token)
    sets the bound: 262,144 tokens a row. Off CUDA the head split is taken at its widest (H / G): the gradient of the
    chunk matrices, 32,768 elements a token, sets a bound of 65,536 tokens."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=132))
    w = BAMBA_9B

    def fits(tokens):
        x = _stand_in((1, tokens, w["heads"], w["head_dim"]), device)
        return fits_int32_offsets(x, _stand_in((1, tokens, w["groups"], w["state"]), device), w["chunk"])

    assert fits(longest_row) and not fits(longest_row + 1)


# ------------------------------------------------------------------------------------------------ version floors


def _installed(monkeypatch, versions: dict[str, str | None]):
    monkeypatch.setattr(backends, "is_installed", lambda name: name in versions or name in (
        "torch_varlen", backends.REFERENCE))
    monkeypatch.setattr(backends, "installed_version",
                        lambda name: versions[name] if name in versions else backends.FLOORS[name].version)


@pytest.mark.parametrize(("backend", "kind", "old", "floor", "instead"), [
    ("flash_attn", "attention", "2.6.3", "2.7.0", "torch_varlen"),
    ("causal_conv1d", "conv", "1.5.0.post8", "1.5.1", backends.REFERENCE),
    ("fla", "delta_rule", "0.5.2", "0.6.0", backends.REFERENCE),  # both delta rules, named as their kind
    ("mamba_ssm", "ssd", "2.2.2", "2.2.3", backends.REFERENCE),
    ("torch_varlen", "attention", "2.10.0+cu128", "2.11.0", backends.REFERENCE),
])
def test_a_library_below_its_floor_is_refused_by_name_and_skipped_by_auto(monkeypatch, backend, kind, old, floor,
                                                                          instead):
    _installed(monkeypatch, {backend: old})
    distribution = backends.FLOORS[backend].distributions[0]
    with pytest.raises(backends.KernelVersionError) as refusal:
        backends.resolve({kind: backend})
    message = str(refusal.value)
    assert f"{distribution} {old} is installed" in message and f"{distribution} >= {floor}" in message
    assert "pip install -U" in message and f"backend={{{kind!r}: {instead!r}}}" in message
    with pytest.warns(KernelSkippedWarning) as skipped:
        chosen = backends.resolve("auto")
    assert {chosen[op] for op in backends.ops_of_kind(kind)} == {instead}
    assert f"{distribution} {old} is installed" in str(skipped[0].message) and f"runs {instead!r}" in str(
        skipped[0].message)
    _installed(monkeypatch, {backend: floor})
    assert {backends.resolve("auto")[op] for op in backends.ops_of_kind(kind)} == {backend}
    assert backends.resolve(backends.REFERENCE) == backends.Backends()


def test_a_library_of_unknown_version_is_refused(monkeypatch):
    _installed(monkeypatch, {"fla": None})
    with pytest.raises(backends.KernelVersionError, match="cannot be read"):
        backends.resolve({"delta_rule": "fla"})
    with pytest.warns(KernelSkippedWarning, match="cannot be read"):
        assert backends.resolve("auto")[GDN] == backends.REFERENCE
    assert backends.resolve({"delta_rule": backends.REFERENCE})[GDN] == backends.REFERENCE


def test_several_refused_libraries_are_named_in_one_error(monkeypatch):
    """Following one refusal's fix must not lead to the next: every refused op is in the one message, and so is
    the one ``backend=`` dict that runs without all of them."""
    _installed(monkeypatch, {"torch_varlen": "2.10.0", "fla": "0.5.2"})
    with pytest.raises(backends.KernelVersionError) as refusal:
        backends.resolve({"attention": "torch_varlen", "delta_rule": "fla"})
    message = str(refusal.value)
    assert "2 kernel libraries" in message and "torch 2.10.0" in message and "fla-core 0.5.2" in message
    assert "backend={'attention': 'reference', 'delta_rule': 'reference'}" in message


def test_ops_outside_the_model_are_neither_resolved_nor_checked(monkeypatch):
    _installed(monkeypatch, {"fla": "0.5.2", "causal_conv1d": "1.5.1"})
    chosen = backends.resolve({"delta_rule": "fla"}, ops=(ATTENTION, CONV))  # asked for, but not used
    assert chosen == backends.Backends({ATTENTION: "torch_varlen", CONV: "causal_conv1d"})


def test_auto_gives_one_warning_naming_every_skip(monkeypatch):
    _installed(monkeypatch, {"mamba_ssm": "2.2.2", "causal_conv1d": "1.5.0"})
    with pytest.warns(KernelSkippedWarning) as skipped:
        backends.resolve("auto")
    assert len(skipped) == 1 and "mamba_ssm for 'ssd'" in str(skipped[0].message)  # the kind: its every op
    assert "causal_conv1d for 'conv'" in str(skipped[0].message)


def test_installed_version_reads_package_metadata_without_importing(monkeypatch):
    seen = []

    def version(distribution):
        seen.append(distribution)
        if distribution == "fla-core":
            raise backends.importlib.metadata.PackageNotFoundError(distribution)
        return "0.6.1"

    monkeypatch.setattr(backends.importlib.metadata, "version", version)
    assert backends.installed_version("fla") == "0.6.1" and seen == ["fla-core", "flash-linear-attention"]


def test_pyproject_extras_name_the_floors():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *(spec for specs in extras.values() for spec in specs)]
    pinned = {spec.split(">=")[0]: spec.split(">=")[1] for spec in specs if ">=" in spec}
    for floor in backends.FLOORS.values():
        assert pinned[floor.distributions[0]] == floor.version.removesuffix(".0"), floor


# ------------------------------------------------------------------------------------------------ fla #640 on Hopper


@pytest.fixture
def no_fla_env(monkeypatch):
    for name in ("FLA_TILELANG", "FLA_DISABLE_BACKEND_DISPATCH", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)


def _hopper_with(monkeypatch, triton: str, tilelang: bool = False, capability: int = 9, nvcc: bool = True):
    """A GPU of ``capability`` with ``triton``; tilelang importable or not; an nvcc found or not (fla's own search,
    mirrored by ``backends.has_usable_nvcc``: faked at its sources, PATH and the filesystem)."""
    monkeypatch.setattr(backends, "_cuda_capability_major", lambda: capability)
    monkeypatch.setattr(backends, "_distribution_version", lambda name: backends.Version(triton))
    monkeypatch.setattr(backends, "is_importable", lambda module: tilelang if module == "tilelang" else True)
    monkeypatch.setattr(backends.shutil, "which", lambda name: "/opt/cuda/bin/nvcc" if nvcc else None)
    monkeypatch.setattr(backends, "_is_file", lambda path: False)
    monkeypatch.setattr(backends.importlib.metadata, "files", lambda name: [])


def test_fla_on_hopper_with_a_triton_that_breaks_its_gated_backward_is_refused(monkeypatch, no_fla_env):
    # seen on the lent H200: Triton 3.6.0, fla 0.6.0 raised at the first backward of every gated-delta-rule layout
    _installed(monkeypatch, {"fla": "0.6.0"})
    _hopper_with(monkeypatch, "3.6.0")
    with pytest.raises(backends.KernelVersionError,
                       match=r"Triton 3\.6\.0 is installed.*fla #640.*tilelang is not installed.*torch>=2\.12\.1"):
        backends.resolve({"delta_rule": "fla"})
    with pytest.warns(KernelSkippedWarning, match=r"fla #640.*runs 'reference' instead"):
        assert backends.resolve("auto")[GDN] == backends.REFERENCE


@pytest.mark.parametrize(("environment", "tilelang", "nvcc", "why"), [
    ({}, True, False, "no nvcc is found"),
    ({"FLA_TILELANG": "0"}, True, True, "FLA_TILELANG=0"),
    ({"FLA_DISABLE_BACKEND_DISPATCH": "1"}, True, True, "FLA_DISABLE_BACKEND_DISPATCH=1"),
])
def test_fla_is_refused_where_its_tilelang_backward_would_not_run(monkeypatch, no_fla_env, environment, tilelang,
                                                                   nvcc, why):
    """fla 0.6 replaces the broken Triton kernel with TileLang's only when tilelang imports, an nvcc is found,
    ``FLA_TILELANG`` is not 0 and backend dispatch is not disabled (``fla/backends.py``): else fla raises."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    _installed(monkeypatch, {"fla": "0.6.0"})
    _hopper_with(monkeypatch, "3.6.0", tilelang=tilelang, nvcc=nvcc)
    with pytest.raises(backends.KernelVersionError, match=why):
        backends.resolve({"delta_rule": "fla"})


@pytest.mark.parametrize("where", ["PATH", "CUDA_HOME", "nvidia-cuda-nvcc"])
def test_fla_tilelang_finds_nvcc_where_fla_looks(monkeypatch, no_fla_env, where):
    _hopper_with(monkeypatch, "3.6.0", tilelang=True, nvcc=where == "PATH")
    if where == "CUDA_HOME":
        monkeypatch.setenv("CUDA_HOME", "/opt/cuda")
        monkeypatch.setattr(backends, "_is_file", lambda path: str(path) == "/opt/cuda/bin/nvcc")
    if where == "nvidia-cuda-nvcc":
        monkeypatch.setattr(backends.importlib.metadata, "files",
                            lambda name: [Path("nvidia/cu13/bin/nvcc")] if name == "nvidia-cuda-nvcc" else [])
    assert backends.fla_tilelang_runs()


@pytest.mark.parametrize(("triton", "tilelang", "capability"), [
    ("3.7.1", False, 9), ("3.3.1", False, 9), ("3.6.0", True, 9), ("3.6.0", False, 8), ("3.6.0", False, 10),
])
def test_fla_is_admitted_where_its_gated_backward_is_right(monkeypatch, no_fla_env, triton, tilelang, capability):
    _installed(monkeypatch, {"fla": "0.6.0"})
    _hopper_with(monkeypatch, triton, tilelang, capability)
    assert backends.resolve("auto")[GDN] == "fla"


# ------------------------------------------------------------------------------------------------ the lent image


@pytest.fixture
def lent_image(monkeypatch, no_fla_env):
    """The lent GPU machine, faked at torch's and importlib's surfaces: Hopper, torch 2.11, Triton 3.6.0, fla 0.6.0
    and mamba-ssm installed, no flash-attn, no causal-conv1d, no tilelang."""
    installed = {"fla": "0.6.0", "mamba_ssm": "2.3.2.post1", "torch_varlen": "2.11.0+cu130"}
    monkeypatch.setattr(backends, "is_installed", lambda name: name in installed or name == backends.REFERENCE)
    monkeypatch.setattr(backends, "installed_version", lambda name: installed[name])
    _hopper_with(monkeypatch, "3.6.0")


@pytest.mark.parametrize(("family", "expected"), [
    ("llama", {ATTENTION: "torch_varlen"}),
    ("bamba", {ATTENTION: "torch_varlen", SSD: "mamba_ssm"}),
    ("kimi_linear", {ATTENTION: "torch_varlen", KDA: "fla"}),  # KDA's backward is not #640's kernel
])
def test_models_without_the_gated_delta_rule_patch_on_the_lent_image_silently(lent_image, family, expected):
    model = build_tiny(family_named(family))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compilepack.patch(model)
    assert patch_state(model).backends == backends.Backends(expected)


def test_qwen3_5_patches_under_auto_with_one_warning_and_is_refused_fla_by_name(lent_image):
    model = build_tiny(family_named("qwen3_5"))
    with pytest.warns(KernelSkippedWarning) as skipped:
        compilepack.patch(model)
    assert len(skipped) == 1 and f"fla for '{GDN}'" in str(skipped[0].message)
    assert f"backend={{'{GDN}': 'reference'}}" in str(skipped[0].message)
    assert patch_state(model).backends == backends.Backends({ATTENTION: "torch_varlen"})
    other = build_tiny(family_named("qwen3_5"))
    with pytest.raises(backends.KernelVersionError, match="fla #640"):
        compilepack.patch(other, backend={"delta_rule": "fla"})
    assert not compilepack.is_patched(other)


def test_tilelang_without_nvcc_is_refused_on_the_lent_image(lent_image, monkeypatch):
    monkeypatch.setattr(backends, "is_importable", lambda module: True)  # tilelang imports; no nvcc anywhere
    monkeypatch.setattr(backends.shutil, "which", lambda name: None)
    with pytest.raises(backends.KernelVersionError, match="no nvcc is found"):
        compilepack.patch(build_tiny(family_named("qwen3_5")), backend={"delta_rule": "fla"})


def test_a_single_op_named_in_backend_wins_over_its_kind(lent_image):
    """On the lent image fla is refused for the gated delta rule only (#640): asking for fla by kind is refused,
    naming that op; naming the op's own choice beside the kind keeps fla for KDA."""
    with pytest.raises(backends.KernelVersionError, match=f"fla for '{GDN}'") as refusal:
        backends.resolve({"delta_rule": "fla"})
    assert f"backend={{'{GDN}': 'reference'}}" in str(refusal.value)
    chosen = backends.resolve({"delta_rule": "fla", GDN: backends.REFERENCE}, ops=(GDN, KDA))
    assert (chosen[GDN], chosen[KDA]) == (backends.REFERENCE, "fla")


def test_backends_are_checked_against_what_each_op_declares():
    """Every op's candidates come from its define_op(kernels=...); a name no op declares is never silently the
    reference."""
    assert backends.candidates(ATTENTION) == ("flash_attn", "torch_varlen", backends.REFERENCE)
    assert backends.candidates("selective_scan_varlen") == (backends.REFERENCE,)
    assert backends.ops_of_kind("delta_rule") == (GDN, KDA)
    with pytest.raises(ValueError, match="must be one of"):
        backends.Backends({CONV: "fla"})
    with pytest.raises(ValueError, match="unknown op 'attention'"):
        backends.Backends()["attention"]
    with pytest.raises(ValueError, match="unknown keys in backend=: \\['atention'\\]"):
        backends.resolve({"atention": "torch_varlen"})
