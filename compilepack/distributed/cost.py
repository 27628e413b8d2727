"""What context parallelism costs: the elements each rank sends per layer, the collectives (latencies) it waits on,
and a model of the step time on a cluster, for the three modes (Ulysses, sequence, hybrid).

The formulas here are the ones docs/context-parallel-evidence.md states; the tests count the elements at every
collective of a real forward and compare them with :func:`elements_sent` (tests/distributed). ``python -m
compilepack.distributed.cost`` prints the docs' tables.

Notation: ``T`` the tokens of all rows of the global batch (padded), ``R`` its rows, ``W`` the context-parallel size
(``U x S`` in the hybrid layout: Ulysses over U ranks, sequence over S), a mixer's widths as :class:`Mixer` names
them. Counts are per rank and per layer, forward; the backward sends as many again (every collective's backward is
its mirror: the reverse all-to-all, the reverse shift, a reduce-scatter for an all-gather).
"""

from __future__ import annotations

import dataclasses
import math

from .scan import chosen_schedule, schedule_elements


@dataclasses.dataclass(frozen=True)
class Mixer:
    """One sequence-mixing layer's widths.

    ``kind``: ``"attention"`` (``heads`` query heads, ``read_heads`` kv heads of ``head_dim``, values ``value_dim``),
    ``"gated_deltanet"`` / ``"kda"`` (``heads`` value heads of ``value_dim``, ``read_heads`` q/k heads of
    ``head_dim``; a conv of ``kernel`` taps over q, k and v), ``"ssd"`` (``heads`` SSM heads of ``value_dim``,
    ``read_heads`` B/C groups of state ``head_dim``; a conv over x, B, C), ``"conv"`` (a short conv over
    ``value_dim`` channels, as LFM2's).
    """

    kind: str
    heads: int = 0
    read_heads: int = 0
    head_dim: int = 0
    value_dim: int = 0
    kernel: int = 4

    @property
    def conv_channels(self) -> int:
        if self.kind in ("gated_deltanet", "kda"):
            return 2 * self.read_heads * self.head_dim + self.heads * self.value_dim
        if self.kind == "ssd":
            return self.heads * self.value_dim + 2 * self.read_heads * self.head_dim
        return self.value_dim if self.kind == "conv" else 0


def mixers_of(config) -> list[Mixer]:
    """The mixer of every layer of a transformers config of the families the tests count (Llama-like, Qwen3-Next /
    Qwen3.5, Bamba)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = Mixer("attention", config.num_attention_heads, config.num_key_value_heads, head_dim, head_dim)
    if getattr(config, "attn_layer_indices", None) is not None:  # Bamba
        mamba = Mixer("ssd", config.mamba_n_heads, config.mamba_n_groups, config.mamba_d_state,
                      config.mamba_expand * config.hidden_size // config.mamba_n_heads, config.mamba_d_conv)
        return [attention if i in config.attn_layer_indices else mamba for i in range(config.num_hidden_layers)]
    if getattr(config, "linear_num_value_heads", None) is not None:  # Qwen3-Next, Qwen3.5
        delta = Mixer("gated_deltanet", config.linear_num_value_heads, config.linear_num_key_heads,
                      config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim)
        return [attention if kind == "full_attention" else delta for kind in config.layer_types]
    return [attention] * config.num_hidden_layers


# ------------------------------------------------------------------------------------------------ elements


def ulysses_elements_per_token(mixer: Mixer, world: int) -> int:
    """Ulysses' ``e``: the elements per token a mixer's all-to-alls exchange (inputs and output), read heads fewer
    than ``world`` replicated (one per rank)."""
    m, read = mixer, max(mixer.read_heads, world)
    if m.kind == "attention":
        return 2 * m.heads * m.head_dim + 2 * read * m.head_dim  # q and out (value_dim = head_dim), k and v
    if m.kind in ("gated_deltanet", "kda"):
        decay = m.heads * (m.head_dim if m.kind == "kda" else 1)
        return 2 * m.conv_channels + 2 * read * m.head_dim + 2 * m.heads * m.value_dim + decay + m.heads
    if m.kind == "ssd":
        inner = m.heads * m.value_dim
        return 2 * m.conv_channels + 2 * inner + m.heads + 2 * read * m.head_dim
    return 2 * m.conv_channels


def _per_rank_read_heads(mixer: Mixer, ulysses: int) -> int:
    return mixer.read_heads // ulysses if mixer.read_heads % ulysses == 0 else 1


def sequence_elements(mixer: Mixer, tokens: int, rows: int, world: int, ulysses: int = 1,
                      schedule: str = "auto") -> tuple[int, int]:
    """``(elements, collectives)`` one rank sends and waits on for a mixer over tokens, on its ``1 / ulysses`` head
    shard (``ulysses = 1``: sequence mode; else the sequence part of the hybrid layout, over ``world`` groups)."""
    m = mixer
    if m.kind == "attention":  # one all-gather of [k | v]
        return (world - 1) * (tokens // world) * _per_rank_read_heads(m, ulysses) * (m.head_dim + m.value_dim), 1
    local = tokens // rows // world
    if local >= m.kernel - 1:  # one send of kernel - 1 tokens to the next rank
        halo = rows * (m.kernel - 1) * m.conv_channels // ulysses
    else:  # slices shorter than the halo: an all-gather of every slice
        halo = (world - 1) * rows * local * m.conv_channels // ulysses
    if m.kind == "conv":
        return halo, 1
    heads = m.heads // ulysses
    if m.kind == "ssd":
        transform, state = rows * heads, rows * heads * m.value_dim * m.head_dim
    else:
        transform, state = rows * heads * m.head_dim**2, rows * heads * m.head_dim * m.value_dim
    schedule = chosen_schedule(transform, state, world, schedule)
    sequential, log = schedule_elements(transform, state, world)
    rounds = world - 1 if schedule == "sequential" else math.ceil(math.log2(world)) + 1
    return halo + (sequential if schedule == "sequential" else log), 1 + rounds * (world > 1)


def elements_sent(mixer: Mixer, tokens: int, rows: int, mode: str, world: int, ulysses: int = 1,
                  schedule: str = "auto") -> tuple[int, int]:
    """``(elements, collectives)`` one rank sends for one mixer layer's forward under ``mode`` (``"ulysses"``,
    ``"sequence"``, ``"hybrid"`` with ``ulysses`` ranks per Ulysses group)."""
    if mode == "ulysses":
        return (world - 1) * tokens * ulysses_elements_per_token(mixer, world) // world**2, _all_to_alls(mixer)
    if mode == "sequence":
        return sequence_elements(mixer, tokens, rows, world, 1, schedule)
    groups = world // ulysses
    heads_part = (ulysses - 1) * (tokens // groups) * ulysses_elements_per_token(mixer, ulysses) // ulysses**2
    tokens_part, collectives = sequence_elements(mixer, tokens, rows, groups, ulysses, schedule)
    return heads_part + tokens_part, _all_to_alls(mixer) + collectives


def _all_to_alls(mixer: Mixer) -> int:
    return {"attention": 4, "gated_deltanet": 8, "kda": 8, "ssd": 7, "conv": 2}[mixer.kind]


# ------------------------------------------------------------------------------------------------ released models


@dataclasses.dataclass(frozen=True)
class Model:
    """A released model's widths as the cost model needs them: its layers' mixers, the FLOPs per token of everything
    that is per token (projections, MLP / MoE experts in use, norms neglected), and its head bound under Ulysses."""

    name: str
    mixers: tuple[Mixer, ...]
    per_token_flops: float  # forward, all layers: projections and MLP / MoE (2 FLOPs per multiply-add)
    ulysses_bound: int  # the largest W Ulysses can split every mixer over (the head counts)


def _qwen3_next_80b() -> Model:
    # Qwen/Qwen3-Next-80B-A3B: 48 layers, 3 Gated DeltaNet : 1 gated attention; hidden 2048; attention 16 q heads
    # (q projection doubled for the output gate), 2 kv heads of 256; DeltaNet 16 q/k heads, 32 value heads, 128 wide;
    # MoE 512 experts of 512, 10 routed + 1 shared per token
    attention = Mixer("attention", 16, 2, 256, 256)
    delta = Mixer("gated_deltanet", 32, 16, 128, 128, 4)
    hidden = 2048
    attention_proj = 2 * hidden * (2 * 16 * 256 + 2 * 2 * 256) + 2 * 16 * 256 * hidden
    delta_proj = 2 * hidden * (2 * 16 * 128 + 2 * 32 * 128 + 2 * 32) + 2 * 32 * 128 * hidden
    moe = 2 * 3 * hidden * 512 * 11
    mixers = (delta, delta, delta, attention) * 12
    flops = 12 * attention_proj + 36 * delta_proj + 48 * moe
    return Model("Qwen3-Next-80B-A3B", mixers, flops, 16)


def _qwen3_5_0_8b() -> Model:
    # Qwen/Qwen3.5-0.8B: 24 layers, 3 Gated DeltaNet : 1 gated attention; hidden 1024; attention 8 q heads, 2 kv heads
    # of 256; DeltaNet 16 q/k and 16 value heads of 128; dense MLP 3584
    attention = Mixer("attention", 8, 2, 256, 256)
    delta = Mixer("gated_deltanet", 16, 16, 128, 128, 4)
    hidden = 1024
    attention_proj = 2 * hidden * (2 * 8 * 256 + 2 * 2 * 256) + 2 * 8 * 256 * hidden
    delta_proj = 2 * hidden * (2 * 16 * 128 + 2 * 16 * 128 + 2 * 16) + 2 * 16 * 128 * hidden
    mixers = (delta, delta, delta, attention) * 6
    flops = 6 * attention_proj + 18 * delta_proj + 24 * 2 * 3 * hidden * 3584
    return Model("Qwen3.5-0.8B", mixers, flops, 8)


def _bamba_9b() -> Model:
    # ibm-ai-platform/Bamba-9B: 32 layers, attention at 9, 18, 27; hidden 4096; attention 32 q heads, 8 kv heads of
    # 128; Mamba2 128 heads of 64, 1 group, state 128, conv 4 (inner 8192); dense MLP 14336
    attention = Mixer("attention", 32, 8, 128, 128)
    mamba = Mixer("ssd", 128, 1, 128, 64, 4)
    hidden = 4096
    attention_proj = 2 * hidden * (32 * 128 + 2 * 8 * 128) + 2 * 32 * 128 * hidden
    mamba_proj = 2 * hidden * (2 * 8192 + 2 * 128 + 128) + 2 * 8192 * hidden
    mixers = tuple(attention if i in (9, 18, 27) else mamba for i in range(32))
    flops = 3 * attention_proj + 29 * mamba_proj + 32 * 2 * 3 * hidden * 14336
    return Model("Bamba-9B", mixers, flops, 32)


MODELS = (_qwen3_next_80b(), _qwen3_5_0_8b(), _bamba_9b())


# ------------------------------------------------------------------------------------------------ the cluster model


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Stated assumptions (H100-class nodes of 8 GPUs): what a rank computes and moves per second."""

    flops: float = 400e12  # bf16 FLOP/s a GPU sustains in these layers (~40% of an H100's 989 TFLOP/s dense peak)
    node_bandwidth: float = 360e9  # bytes/s per GPU and direction inside a node (NVLink; ~80% of 450 GB/s)
    network_bandwidth: float = 45e9  # bytes/s per GPU across nodes (400 Gb/s InfiniBand, ~90%)
    node_latency: float = 10e-6  # seconds per collective (or state-pass round) inside a node
    network_latency: float = 25e-6  # ... across nodes
    gpus_per_node: int = 8
    activation_bytes: int = 2  # bf16 activations
    state_bytes: int = 4  # fp32 states (the state pass)


def _mixer_flops(mixer: Mixer, tokens: int) -> float:
    """Forward FLOPs of a mixer's token-mixing core (not its projections) over ``tokens`` tokens of one document
    (the long-context case): causal attention ``2 T^2 H D``; the chunked linear mixers ``~ 6 K V + 4 C (K + V)`` per
    token and head (C = 64)."""
    m = mixer
    if m.kind == "attention":
        return 2.0 * tokens**2 * m.heads * m.head_dim
    if m.kind == "conv":
        return 2.0 * tokens * m.kernel * m.value_dim
    return tokens * m.heads * (6 * m.head_dim * m.value_dim + 4 * 64 * (m.head_dim + m.value_dim))


def step_time(model: Model, mode: str, world: int, tokens: int, ulysses: int = 1,
              cluster: Cluster = Cluster()) -> dict:
    """A model of one training step's time per rank (forward + backward: 3x the forward FLOPs, 2x the forward
    communication, no overlap of the two) for one row of ``tokens`` tokens holding one document (the case context
    parallelism exists for). Over tokens the causal attention of contiguous slices is unbalanced: the last rank's
    queries see every key, so the slowest rank does ``(2S - 1) / S^2`` of the attention (S the sequence size).
    Returns seconds: ``compute``, ``communication``, ``total``; None when Ulysses cannot split the model."""
    if mode == "ulysses" and (world > model.ulysses_bound or model.ulysses_bound % world):
        return None
    sequence = world if mode == "sequence" else world // ulysses if mode == "hybrid" else 1
    compute = model.per_token_flops * tokens / world
    communication = 0.0
    for mixer in model.mixers:
        core = _mixer_flops(mixer, tokens)
        if mixer.kind == "attention" and sequence > 1:
            core *= (2 * sequence - 1) / sequence**2 / (world // sequence)
        else:
            core /= world
        if mixer.kind in ("gated_deltanet", "kda") and sequence > 1:
            core *= 1 + mixer.head_dim / mixer.value_dim / 2  # the value columns [v | 0] of the identity pass (~)
        compute += core
        communication += _communication_time(mixer, mode, world, tokens, ulysses, cluster)
    compute = 3 * compute / cluster.flops
    return {"compute": compute, "communication": 2 * communication, "total": compute + 2 * communication}


def _communication_time(mixer: Mixer, mode: str, world: int, tokens: int, ulysses: int, cluster: Cluster) -> float:
    """Forward seconds of one mixer's collectives: each part's bytes over the bandwidth of the links it crosses, plus
    one latency per collective. Ulysses groups sit inside a node where they fit; the sequence part crosses nodes once
    the world does."""
    across = world > cluster.gpus_per_node
    ulysses_fast = (world if mode == "ulysses" else ulysses) <= cluster.gpus_per_node
    heads_part = tokens_part = 0
    heads_calls = tokens_calls = 0
    if mode in ("ulysses", "hybrid"):
        size = world if mode == "ulysses" else ulysses
        groups = world // size
        heads_part = (size - 1) * (tokens // groups) * ulysses_elements_per_token(mixer, size) // size**2
        heads_calls = _all_to_alls(mixer)
    if mode in ("sequence", "hybrid"):
        elements, tokens_calls = sequence_elements(mixer, tokens, 1, world // ulysses if mode == "hybrid" else world,
                                                   ulysses if mode == "hybrid" else 1)
        tokens_part = elements
    state_share = 0 if mixer.kind in ("attention", "conv") else 1  # the state pass moves fp32
    seconds = 0.0
    if heads_part:
        bandwidth = cluster.node_bandwidth if ulysses_fast and (mode == "hybrid" or not across) else \
            cluster.network_bandwidth
        latency = cluster.node_latency if bandwidth == cluster.node_bandwidth else cluster.network_latency
        seconds += heads_part * cluster.activation_bytes / bandwidth + heads_calls * latency
    if tokens_part:
        bandwidth = cluster.network_bandwidth if across else cluster.node_bandwidth
        latency = cluster.network_latency if across else cluster.node_latency
        width = cluster.state_bytes if state_share else cluster.activation_bytes
        seconds += tokens_part * width / bandwidth + tokens_calls * latency
    return seconds


def mixer_memory(mixer: Mixer, mode: str, world: int, tokens: int, ulysses: int = 1,
                 cluster: Cluster = Cluster()) -> float:
    """Bytes of activations one rank keeps for a mixer's backward (the slowest rank's), for one row of ``tokens``:
    attention its q and output, its keys and values (over tokens: the gathered ones up to its slice end, the whole
    row's on the last rank of a sequence group); the linear mixers their inputs and output (over tokens with the
    value columns ``[v | 0]``, ``V + K`` wide). Not counted: what a kernel saves beside them (compilepack's
    reference also keeps fp32 states at every chunk start, ``T / 64 x H x K x V`` per layer and rank, where fla's
    kernels recompute them), and the per-token layers, the same in every mode (``T / W`` tokens each)."""
    m, width = mixer, cluster.activation_bytes
    shards = world if mode == "ulysses" else ulysses if mode == "hybrid" else 1  # the heads split over
    rows = tokens if mode == "ulysses" else tokens // (world // shards)  # the tokens the op runs on
    read = max(m.read_heads, shards) // shards  # read heads per rank (replicated when fewer than the shards)
    heads = m.heads // shards
    if m.kind == "attention":
        keys = tokens if mode != "ulysses" else rows  # the last rank of a sequence group holds every key
        return (2 * rows * heads * m.head_dim + 2 * keys * read * m.head_dim) * width
    if m.kind == "ssd":
        return rows * (2 * heads * m.value_dim + 2 * read * m.head_dim + heads) * width
    if m.kind == "conv":
        return 2 * rows * m.value_dim * width
    values = m.value_dim + (m.head_dim if mode != "ulysses" else 0)
    return rows * (2 * read * m.head_dim + 2 * heads * values + 2 * heads) * width


# ------------------------------------------------------------------------------------------------ the docs' tables


def _format_bytes(value: float) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def tables(cluster: Cluster = Cluster()) -> str:
    """docs/context-parallel-evidence.md's comparison: per model, W and row length, each mode's communication per
    rank and layer (forward), its collectives, the mixers' memory per rank, and the modelled step time."""
    lines = ["| model | W | tokens | mode | sent per rank, attention layer | sent per rank, linear layer | collectives "
             "per layer (attention / linear) | mixers' activations per rank (all layers) | step: compute + "
             "communication (s) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model in MODELS:
        attention = next(m for m in model.mixers if m.kind == "attention")
        linear = next(m for m in model.mixers if m.kind != "attention")
        for tokens in (128 * 1024, 1024 * 1024):
            for world in (8, 32, 128):
                best = None
                rows = []
                for mode in ("ulysses", "sequence", "hybrid"):
                    # hybrid: Ulysses inside a node (at most the head bound), at least 2 sequence groups
                    ulysses = min(model.ulysses_bound, cluster.gpus_per_node, world // 2) if mode == "hybrid" else 1
                    step = step_time(model, mode, world, tokens, ulysses, cluster)
                    label = mode if mode != "hybrid" else f"hybrid {ulysses} x {world // ulysses}"
                    if step is None:
                        rows.append((label, None))
                        continue
                    sent = [elements_sent(m, tokens, 1, mode, world, ulysses) for m in (attention, linear)]
                    memory = sum(mixer_memory(m, mode, world, tokens, ulysses, cluster) for m in model.mixers)
                    rows.append((label, (sent, memory, step)))
                    best = step["total"] if best is None else min(best, step["total"])
                for label, figures in rows:
                    if figures is None:
                        lines.append(f"| {model.name} | {world} | {tokens // 1024}k | {label} | - | - | - | - | "
                                     f"W > {model.ulysses_bound} heads |")
                        continue
                    (att, lin), memory, step = figures
                    bold = "**" if step["total"] == best else ""
                    lines.append(
                        f"| {model.name} | {world} | {tokens // 1024}k | {label} | {att[0] / 1e6:.1f} M | "
                        f"{lin[0] / 1e6:.2f} M | {att[1]} / {lin[1]} | {_format_bytes(memory)} | "
                        f"{bold}{step['compute']:.2f} + {step['communication']:.2f}{bold} |"
                    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(tables())
