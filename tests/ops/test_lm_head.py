"""compilepack::lm_head_logprobs: chunked statistics == the whole-logits oracle (fp64, hypothesis: token counts that
are not a multiple of the chunk, chunks whose targets are all ignored, 1-token inputs), exact fp64 gradients
(gradcheck), opcheck of both custom ops, one graph and one compile over changing token counts, bf16 autocast within
2x the stock head's own bf16 error, and extra memory that does not grow with the token count.

Tolerances: fp64 against the fp64 oracle, 1e-10 of the largest entry (measured: <= 5e-15). Each comparison has its
control beside it: the same statistic with the ignored targets scored (``ignore_index`` dropped) misses by > 0.1.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from compilepack.ops.lm_head import OP, STATS, lm_head_logprobs, lm_head_naive, reference
from tests.ops import contract
from tests.ops.properties import gradcheck, max_error

FP64_TOL = 1e-10
EVERY_STAT = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
TRANSFORMS = [dict(), dict(logit_scale=0.5, softcap=3.0, temperature=0.7)]


def make_inputs(tokens, hidden=12, vocab=50, dtype=torch.float64, seed=0, bias=True, ignored=()):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    b = torch.randn(vocab, generator=gen, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[list(ignored)] = -100
    return h, w, b, targets


def weighted_sum(stats: dict, seed=1) -> torch.Tensor:
    """A loss that reaches every differentiable statistic with its own random weights."""
    gen = torch.Generator().manual_seed(seed)
    total = 0
    for name in ("log_probs", "entropy", "log_z"):
        value = stats[name]
        total = total + (value * torch.randn(value.shape, generator=gen, dtype=value.dtype)).sum()
    return total


def chunked(h, w, b, targets, chunk, **transforms) -> dict:
    return lm_head_logprobs(h, w, b, targets, chunk_tokens=chunk, stats=EVERY_STAT, **transforms)._asdict()


@st.composite
def layouts(draw):
    """(tokens, chunk, ignored positions): token counts around chunk multiples, whole chunks ignored, 1 token."""
    chunk = draw(st.sampled_from([1, 3, 8, 16]))
    tokens = draw(st.sampled_from([1, chunk - 1, chunk, chunk + 1, 3 * chunk + 2, 37]).filter(lambda n: n >= 1))
    kind = draw(st.sampled_from(["none", "first_chunk", "all", "random"]))
    ignored = {"none": [], "first_chunk": list(range(min(chunk, tokens))), "all": list(range(tokens)),
               "random": draw(st.lists(st.integers(0, tokens - 1), max_size=tokens))}[kind]
    return tokens, chunk, sorted(set(ignored))


@given(layouts(), st.sampled_from(TRANSFORMS), st.booleans())
def test_statistics_and_gradients_equal_the_whole_logits(layout, transforms, bias):
    tokens, chunk, ignored = layout
    h, w, b, targets = make_inputs(tokens, bias=bias, ignored=ignored)
    got, want = chunked(h, w, b, targets, chunk, **transforms), lm_head_naive(h, w, b, targets, **transforms)
    for name in STATS:
        if name == "is_top1":
            assert torch.equal(got[name], want[name])
        else:
            assert max_error(got[name], want[name]) <= FP64_TOL, name
    inputs = [x for x in (h, w, b) if x is not None]
    grads, expected = torch.autograd.grad(weighted_sum(got), inputs), torch.autograd.grad(weighted_sum(want), inputs)
    for grad, reference_grad in zip(grads, expected):
        assert max_error(grad, reference_grad) <= FP64_TOL


def test_control_scoring_ignored_targets_misses():
    """The comparison can fail: with ignore_index dropped (ignored positions scored as class 0), log_probs and the
    gradients miss the oracle by far more than the tolerance."""
    h, w, b, targets = make_inputs(30, ignored=range(0, 30, 3))
    got = chunked(h, w, b, targets.clamp(min=0), 8)
    want = lm_head_naive(h, w, b, targets)
    assert max_error(got["log_probs"], want["log_probs"]) > 0.1
    assert max_error(torch.autograd.grad(-got["log_probs"].sum(), h)[0],
                     torch.autograd.grad(-want["log_probs"].sum(), h)[0]) > 0.1


def test_loss_equals_cross_entropy_in_fp32():
    """In fp32 the summed log-probabilities are F.cross_entropy's (ignore_index, reduction sum), to 1e-6 relative,
    and so are the gradients of hidden, weight and bias."""
    h, w, b, targets = make_inputs(300, hidden=64, vocab=1000, dtype=torch.float32, ignored=range(0, 300, 7))
    ours = -lm_head_logprobs(h, w, b, targets, chunk_tokens=64).log_probs.sum()
    stock = F.cross_entropy(F.linear(h, w, b).float(), targets, reduction="sum")
    assert abs(ours.item() - stock.item()) <= 1e-6 * abs(stock.item())
    for got, want in zip(torch.autograd.grad(ours, (h, w, b)), torch.autograd.grad(stock, (h, w, b))):
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_gradcheck_fp64():
    h, w, b, targets = make_inputs(9, hidden=4, vocab=11, ignored=[2])

    def run(h, w, b):
        out = lm_head_logprobs(h, w, b, targets, chunk_tokens=4, logit_scale=0.7, softcap=2.0, temperature=1.3,
                               stats=("entropy",))
        return out.log_probs, out.entropy, out.log_z

    assert gradcheck(run, [h, w, b])


def test_opcheck_forward_and_backward():
    h, w, b, targets = make_inputs(10, hidden=4, vocab=7, dtype=torch.float32, ignored=[0])
    args = (h, w, b, targets, -100, 4, torch.float32, 1.0, 0.0, 1.0, [True, True, False, True], "reference")
    contract.opcheck_forward_and_backward(OP, args, [True, True, True], with_output=True)


def _loss(h, w, targets):
    out = lm_head_logprobs(h, w, None, targets, chunk_tokens=16, stats=("entropy",))
    return -out.log_probs.sum() + out.entropy.sum() * 0.1


def _grads(h, w, targets):
    return torch.autograd.grad(_loss(h, w, targets), (h, w))


def test_one_graph_and_one_compile_over_token_counts():
    h, w, _, targets = make_inputs(40, dtype=torch.float32)
    contract.assert_one_graph(_loss, _grads, (h, w, targets))
    # (not 1 token: dynamo specialises a size of 1)
    calls = [make_inputs(n, dtype=torch.float32, seed=n, bias=False, ignored=[0]) for n in (40, 17, 2, 64)]
    contract.assert_compiles_once(_loss, [(h, w, t) for h, w, _, t in calls], backward=True)
    contract.assert_aot_eager_grads_equal_eager(_loss, [h, w], [targets], ["hidden", "weight"])


def test_bf16_autocast_within_twice_the_stock_heads_error():
    """Under CPU bf16 autocast the op computes the logits in bf16, as the stock lm_head does, and everything after
    in fp32: its loss and gradients are within 2x the stock head's (autocast linear, then fp32 cross-entropy) error
    against the fp32 reference."""
    h, w, b, targets = make_inputs(200, hidden=64, vocab=500, dtype=torch.float32, ignored=range(0, 200, 5))

    def ours():
        return -lm_head_logprobs(h, w, b, targets, chunk_tokens=48).log_probs.sum()

    def stock():
        return F.cross_entropy(F.linear(h, w, b).float(), targets, reduction="sum")

    reference_loss, reference_grads = stock(), torch.autograd.grad(stock(), (h, w, b))
    errors = {}
    for name, fn in (("ours", ours), ("stock", stock)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn()
        grads = torch.autograd.grad(loss, (h, w, b))
        errors[name] = [abs(loss.item() - reference_loss.item())]
        errors[name] += [max_error(g, r) for g, r in zip(grads, reference_grads)]
    assert all(o <= 2 * s + 1e-6 for o, s in zip(errors["ours"], errors["stock"])), errors
    assert errors["stock"][0] > 1e-3  # the comparison is made at bf16 precision, not fp32


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode and still alive; ``peak`` their maximum."""

    def __init__(self):
        super().__init__()
        self.sizes, self.holders, self.now, self.peak, self.external = {}, {}, 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._hold(t)
        return out

    def _hold(self, t):
        pointer = t.untyped_storage().data_ptr()
        if pointer in self.external:
            return
        if pointer not in self.holders:
            self.holders[pointer], self.sizes[pointer] = 0, t.untyped_storage().nbytes()
            self.now += self.sizes[pointer]
            self.peak = max(self.peak, self.now)
        self.holders[pointer] += 1
        weakref.finalize(t, self._release, pointer)

    def _release(self, pointer):
        self.holders[pointer] -= 1
        if not self.holders[pointer]:
            del self.holders[pointer]
            self.now -= self.sizes.pop(pointer)


def _peak_bytes(tokens, hidden=16, vocab=2048, chunk=32) -> int:
    """Peak bytes the reference's forward and backward allocate for ``tokens`` tokens (inputs not counted)."""
    h, w, _, targets = make_inputs(tokens, hidden=hidden, vocab=vocab, dtype=torch.float32, bias=False)
    h, w = h.detach(), w.detach()
    args = (h, w, None, targets, -100, chunk, torch.float32, 1.0, 0.0, 1.0, [True, False, False, False, False])
    with _LiveBytes() as live:
        live.external = {x.untyped_storage().data_ptr() for x in (h, w, targets)}
        out, _ = reference.forward(*args)
        reference.backward(torch.ones_like(out), out, [], [True, True, False], *args)
    return live.peak


def test_extra_memory_does_not_grow_with_the_token_count():
    """From 256 to 4,096 tokens (vocabulary 2,048, chunks of 32 tokens) the peak grows only by the per-token rows
    (the gradient of hidden, the statistics and their gradient: 28 floats per token), never by a [T, V] tensor:
    measured 64 bytes/token of [T, V] would be 8,192."""
    hidden, vocab, chunk = 16, 2048, 32
    small, large = _peak_bytes(256, hidden, vocab, chunk), _peak_bytes(4096, hidden, vocab, chunk)
    per_token_rows = (hidden + 2 * len(STATS)) * 4
    assert large - small <= (4096 - 256) * per_token_rows * 1.05, (small, large)
    tile = chunk * vocab * 4
    assert large <= 6 * tile + 2 * vocab * hidden * 4 + 4096 * per_token_rows, large
    assert large < 4096 * vocab * 4 / 4  # under a quarter of one fp32 copy of the logits


def test_control_whole_logits_grow_with_the_token_count():
    """The measurement sees [T, V] tensors when there are: one chunk as large as the input makes the peak grow by
    more than the whole fp32 logits."""
    assert _peak_bytes(4096, chunk=4096) - _peak_bytes(256, chunk=256) > (4096 - 256) * 2048 * 4


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(hidden=a["hidden"][None]), "hidden must be a float [N, H] tensor"),
        (lambda a: a.update(weight=a["weight"][:, :3]), "weight must be a float [V, H] tensor with H=12"),
        (lambda a: a.update(targets=a["targets"].float()), "targets must be an integer [N] tensor with N=5"),
        (lambda a: a.update(stats=("entropy", "logits")), "stats: unknown statistics ['logits']"),
        (lambda a: a.update(chunk_tokens=0), "chunk_tokens must be a positive number of tokens, got 0"),
    ],
)
def test_bad_arguments_are_refused_with_the_argument_named(change, message):
    h, w, b, targets = make_inputs(5)
    args = dict(hidden=h, weight=w, bias=b, targets=targets)
    contract.assert_refused(lambda **a: lm_head_logprobs(**a), args, change, message)
