"""Where a training step's time goes (mixers / MLP / LM head / loss / optimizer / other), and the model FLOPs that
the step's utilisation (MFU) is counted from.

The time split is measured on one extra eager step, with hooks, not a profiler: a forward pre-hook and hook on each
mixer, MLP and the LM head time their forwards; hooks on the gradient of each such module's output (fires when its
backward starts) and of its input (fires when its backward has finished) time their backwards. CPU autograd runs
one node at a time, and a module's input here (a norm's output, or the final hidden states) feeds only that
module, so the two marks bracket the module's backward. The loss is what the model's forward does after the LM
head (its forward), and what the backward does before the LM head's output gradient exists (its backward).
"""

from __future__ import annotations

import time

import torch
from torch import nn

CATEGORIES = ("mixers", "mlp", "lm_head", "loss", "optimizer", "other")
# The decoder-layer attributes that hold a sequence mixer or an MLP, over the families the bench runs.
MIXER_NAMES = ("self_attn", "linear_attn", "mamba", "mixer", "attention", "conv", "feed_forward_mixer")
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")


def categorized_modules(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The model's mixers, MLPs and LM head, found by the attribute names decoder layers give them."""
    found, taken = {"mixers": [], "mlp": [], "lm_head": []}, []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        inside = ".layers." in f".{name}" and not any(name.startswith(prefix + ".") for prefix in taken)
        category = "mixers" if leaf in MIXER_NAMES else "mlp" if leaf in MLP_NAMES else None
        if inside and category:  # a module inside one already counted is not counted again
            found[category].append(module)
            taken.append(name)
    head = model.get_output_embeddings()
    if head is not None:
        found["lm_head"].append(head)
    return found


class TimeSplit:
    """``with TimeSplit(model) as split: <forward, backward>``; then ``split.seconds`` per category (forward and
    backward together), ``split.lm_head_forward_end`` and ``split.lm_head_backward_start`` (perf_counter marks)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.seconds = {category: 0.0 for category in ("mixers", "mlp", "lm_head")}
        self.lm_head_forward_end = None
        self.lm_head_backward_start = None
        self._handles = []

    def __enter__(self) -> TimeSplit:
        for category, modules in categorized_modules(self.model).items():
            for module in modules:
                self._watch(module, category)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _watch(self, module: nn.Module, category: str) -> None:
        started = {}

        def before(mod, args, kwargs):
            started["forward"] = time.perf_counter()
            tensor = _first_grad_tensor(args, kwargs)
            if tensor is not None:  # its gradient is ready when this module's backward is done
                tensor.register_hook(lambda grad: self._backward_done(category, started))

        def after(mod, args, kwargs, output):
            now = time.perf_counter()
            self.seconds[category] += now - started.pop("forward")
            if category == "lm_head":
                self.lm_head_forward_end = now
            tensor = _first_grad_tensor((output,), {})
            if tensor is not None:  # its gradient arrives when this module's backward starts
                tensor.register_hook(lambda grad: self._backward_starts(category, started))

        self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        self._handles.append(module.register_forward_hook(after, with_kwargs=True))

    def _backward_starts(self, category: str, started: dict) -> None:
        started["backward"] = time.perf_counter()
        if category == "lm_head":
            self.lm_head_backward_start = started["backward"]

    def _backward_done(self, category: str, started: dict) -> None:
        if "backward" in started:
            self.seconds[category] += time.perf_counter() - started.pop("backward")


def _first_grad_tensor(args, kwargs):
    for value in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(value, (tuple, list)):
            value = next((v for v in value if isinstance(v, torch.Tensor)), None)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value
    return None


def split_step(model, tensors: dict, optimizer) -> dict:
    """One eager training step on ``tensors``, timed by category: ``{category: seconds}`` and ``total``."""
    with TimeSplit(model) as split:
        start = time.perf_counter()
        output = model(**tensors)
        forward_end = time.perf_counter()
        output.loss.backward()
        backward_end = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    end = time.perf_counter()
    seconds = dict(split.seconds)
    loss_forward = forward_end - split.lm_head_forward_end if split.lm_head_forward_end else 0.0
    loss_backward = split.lm_head_backward_start - forward_end if split.lm_head_backward_start else 0.0
    seconds["loss"] = loss_forward + loss_backward
    seconds["optimizer"] = end - backward_end
    seconds["other"] = max(0.0, (end - start) - sum(seconds.values()))
    return {**{k: round(seconds[k], 4) for k in CATEGORIES}, "total": round(end - start, 4)}


# ------------------------------------------------------------------------------------------------ FLOPs


def linear_flops_per_token(model: nn.Module) -> float:
    """Matmul FLOPs per token of a training step over every ``nn.Linear``: 2 per weight forward, 2 more for the
    input gradient, 2 more for the weight gradient when the weight trains (6, or 4 for a frozen weight)."""
    total = 0.0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.numel() * (6 if module.weight.requires_grad else 4)
    return total


def attention_flops(model: nn.Module, doc_lengths: list[int]) -> float:
    """Causal softmax attention's score and value matmuls over documents of ``doc_lengths`` (each attends to
    itself only), forward and backward: ``6 * L^2 * head_dim * heads`` per document and attention layer."""
    config = model.config.get_text_config()
    layers = _attention_layers(config)
    if not layers:
        return 0.0
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6.0 * layers * heads * head_dim * sum(length * length for length in doc_lengths)


def _attention_layers(config) -> int:
    layer_types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if layer_types:
        return sum(1 for kind in layer_types if "attention" in kind and "linear" not in kind)
    indices = getattr(config, "attn_layer_indices", None)
    if indices is not None:
        return len(indices)
    return config.num_hidden_layers


def step_flops(model: nn.Module, doc_lengths: list[int]) -> float:
    """The model FLOPs of one training step on these documents' real tokens (padding does no useful work):
    linear layers and softmax attention; the linear mixers' state math (GDN, SSD, conv) is not counted."""
    return linear_flops_per_token(model) * sum(doc_lengths) + attention_flops(model, doc_lengths)


def matmul_gflops(threads: int | None = None, size: int = 2048, repeats: int = 5) -> dict:
    """This machine's fp32 matmul throughput now: ``size``-cubed ``torch.mm``, best and median of ``repeats``."""
    import statistics

    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # first call: allocation, thread pool
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            rates.append(2 * size**3 / (time.perf_counter() - start) / 1e9)
    finally:
        torch.set_num_threads(saved)
    return {"gflops_best": round(max(rates), 1), "gflops_median": round(statistics.median(rates), 1),
            "shape": f"{size}x{size} @ {size}x{size} fp32", "threads": threads or saved}
