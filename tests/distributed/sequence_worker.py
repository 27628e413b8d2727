"""Spawned side of the tests of context parallelism over tokens (sequence mode) and the hybrid layout
(test_sequence_parallel.py): checks that ``worker.spawn`` runs on W gloo processes as ``"sequence_worker.<check>"``.

Every check runs on every rank (they all take part in the collectives) and returns plain numbers; rank 0's figures
reach the test process.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import sys

import torch
import torch.distributed as dist

from tests.distributed.worker import (
    _build,
    _gather_tokens,
    _grads,
    _local_batch,
    _max_over_ranks,
    _relative,
    _slice,
    _summed_grads,
    compiled_against_eager,
    one_process_step,
)

ROW_LENGTHS = [70, 1, 23, 5, 30]  # 129 tokens: padded for every W; the 70-token document spans 3 ranks at W >= 4
TWO_ROW_LENGTHS = [40, 30, 20, 15, 1]  # two rows of 61 tokens (PackedCollator(max_length=64, flatten=False))
# 128 tokens (no padding): documents that end and start exactly at rank edges (32 at W = 4 and 8, 48 at W = 8), a
# 1-token document starting at an edge, a 48-token document across the edge at 64 (and 96 at W = 4: three ranks; and
# 80 and 96 at W = 8: four ranks)
EDGE_LENGTHS = [32, 1, 15, 8, 48, 24]

# tiny configs with fewer heads than ranks: 2 query heads, 1 kv head (and one or two heads for every linear mixer)
FEW_HEADS = {
    "llama": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16),
    "qwen3_next": dict(num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=1,
                       linear_num_value_heads=2),
    "qwen3_5": dict(num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=2),
    "bamba": dict(num_attention_heads=2, num_key_value_heads=1, mamba_n_heads=2, mamba_n_groups=1, mamba_d_head=64),
}


# ------------------------------------------------------------------------------------------------ the group


@functools.cache
def _mesh(sequence: int, ulysses: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (sequence, ulysses), mesh_dim_names=("sequence", "ulysses"))


def context_parallel(mode: str, state_pass: str = "auto"):
    """The world as one context-parallel group: ``"sequence"``, ``"hybrid"`` (Ulysses over 2 ranks, sequence over
    W / 2) or ``"hybrid4"`` (Ulysses over 4, sequence over W / 4)."""
    from compilepack.distributed import ContextParallel

    world = dist.get_world_size()
    if mode == "sequence":
        return ContextParallel.sequence_parallel(dist.group.WORLD, state_pass=state_pass)
    ulysses = 4 if mode == "hybrid4" else 2
    if state_pass == "auto":
        return ContextParallel.of(_mesh(world // ulysses, ulysses))  # a 2-D mesh named ("sequence", "ulysses")
    mesh = _mesh(world // ulysses, ulysses)
    return ContextParallel.hybrid(mesh, state_pass=state_pass)


@contextlib.contextmanager
def _without_passing():
    """The control: no state pass (every slice's first document starts from zero) and no halo (the conv reads zeros
    before the slice start)."""
    from compilepack.distributed import collectives, scan

    incoming, halo = scan.incoming_states, collectives.halo
    scan.incoming_states = lambda transform, final, continues, cp, schedule=None: final * 0
    collectives.halo = lambda tail, cp: torch.zeros_like(tail)
    try:
        yield
    finally:
        scan.incoming_states, collectives.halo = incoming, halo


def _batches(vocab_size: int) -> dict[str, dict]:
    from compilepack import PackedCollator
    from tests.models import hf_batch, random_docs

    two_rows = PackedCollator(max_length=64, flatten=False)
    return {
        "row": hf_batch(random_docs(vocab_size, ROW_LENGTHS, seed=1)),
        "two_rows": two_rows([{"input_ids": d} for d in random_docs(vocab_size, TWO_ROW_LENGTHS, seed=2)]),
        "edges": hf_batch(random_docs(vocab_size, EDGE_LENGTHS, seed=3)),
    }


# ------------------------------------------------------------------------------------------------ families


def _amplified_convs(model: torch.nn.Module, factor: float = 50.0) -> torch.nn.Module:
    """The model with its causal convs' weights scaled: at initialisation (std 0.02) the taps a halo brings change the
    logits of some families by less than 1e-3 (LFM2's short convs, Falcon-H1's), too little for the control (the halo
    skipped) to miss by far; the exactness check runs on the same weights."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Conv1d):
                module.weight.mul_(factor)
    return model



def family_equality(family_name: str, mode: str, heads: str = "tiny") -> dict:
    """CP over the world (``mode``) == one process: logits, loss, every parameter's gradient summed over the ranks,
    for three batches; controls: no state pass and no halo (``control_no_pass``), every rank on its slice alone
    (``control_local``), no gradient sum."""
    import compilepack
    from compilepack.distributed import shard_batch

    cp = context_parallel(mode)
    base = _amplified_convs(_build(family_name, **(FEW_HEADS[family_name] if heads == "few" else {})))
    reference = compilepack.patch(copy.deepcopy(base))
    parallel = compilepack.patch(copy.deepcopy(base), context_parallel=cp)
    figures = {}
    for name, batch in _batches(base.config.vocab_size).items():
        parallel.zero_grad()
        expected = one_process_step(reference, batch)
        sharded = shard_batch(batch, cp)
        out = parallel(**sharded)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        length = batch["input_ids"].shape[1]
        padded = torch.nn.functional.pad(expected.logits.detach(), (0, 0, 0, sharded["seq_idx"].shape[1] - length))
        mine = padded[:, _slice(sharded)]
        real = torch.arange(sharded["seq_idx"].shape[1])[_slice(sharded)] < length  # not the padding document
        with torch.no_grad():
            alone = reference(**_local_batch(sharded)).logits
            with _without_passing():
                unpassed = parallel(**sharded).logits
        figures[name] = {
            "world": dist.get_world_size(), "tokens": length, "local_tokens": sharded["input_ids"].shape[1],
            "loss": abs(loss.item() - expected.loss.item()) / expected.loss.item(),
            "logits": (_gather_tokens(out.logits.detach(), length) - expected.logits).abs().max().item(),
            "grads": _relative(_summed_grads(parallel), _grads(reference)),
            "control_local": _max_over_ranks((alone - mine)[:, real].abs().max()),
            "control_no_pass": _max_over_ranks((unpassed - mine)[:, real].abs().max()),
            "control_grads": _relative(_grads(parallel), _grads(reference)),
        }
    return figures


# ------------------------------------------------------------------------------------------------ compiling


def _stream(vocab_size: int) -> list[dict]:
    """Varied one-row batches: lengths and document counts change, documents cross rank edges; two need a padding
    document at W = 2, 4 and 8."""
    from tests.models import hf_batch, random_docs

    lengths = [[12, 40, 1, 26], [3, 50, 9, 1, 17, 33, 5], [101]]  # 79, 118 and 101 tokens
    return [hf_batch(random_docs(vocab_size, n, seed=10 + i)) for i, n in enumerate(lengths)]


def compile_model(family_name: str, mode: str) -> dict:
    """torch.compile(fullgraph=True, dynamic=True, aot_eager) of the model under the group's layout, per rank, over a
    varied stream, forward + backward: graphs, compiles, and compiled == eager (logits, gradients)."""
    import compilepack
    from compilepack.distributed import shard_batch

    cp = context_parallel(mode)
    model = compilepack.patch(_build(family_name), context_parallel=cp)
    step = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    batches = [shard_batch(b, cp) for b in _stream(model.config.vocab_size)]
    return {**compiled_against_eager(model, step, batches), **_compiles(graphs_before)}


def _compiles(graphs_before: int) -> dict:
    """The most graphs any rank compiled since ``graphs_before`` (a recompile or a graph break is one more; a
    restarted analysis of one frame is not: tests/compiling.py)."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    return {"graphs": int(_max_over_ranks(torch.tensor(graphs)))}


# ------------------------------------------------------------------------------------------------ communication


@contextlib.contextmanager
def counting_collectives():
    """Count what this rank sends at every collective (elements leaving the rank) while the block runs:
    ``{"elements": int, "collectives": int}``."""
    from compilepack.distributed import collectives

    count = {"elements": 0, "collectives": 0}
    originals = collectives.all_to_all, collectives.send_forward, collectives.all_gather

    def all_to_all(send, cp):
        count["elements"] += send.numel() * (cp.size - 1) // cp.size  # the rank's own chunk stays
        count["collectives"] += 1
        return originals[0](send, cp)

    def send_forward(x, cp, distance=1):
        count["elements"] += x.numel()
        count["collectives"] += 1
        return originals[1](x, cp, distance)

    def all_gather(x, cp, dim):
        count["elements"] += x.numel() * (cp.size - 1)
        count["collectives"] += 1
        return originals[2](x, cp, dim)

    collectives.all_to_all, collectives.send_forward, collectives.all_gather = all_to_all, send_forward, all_gather
    try:
        yield count
    finally:
        collectives.all_to_all, collectives.send_forward, collectives.all_gather = originals


def communication(family_name: str, mode: str, state_pass: str = "auto") -> dict:
    """Elements this rank sends in one forward (every collective counted as it runs) against
    ``compilepack.distributed.cost.elements_sent`` summed over the layers, and the collectives it waits on."""
    import compilepack
    from compilepack.distributed import cost, shard_batch

    cp = context_parallel(mode, state_pass)
    model = compilepack.patch(_build(family_name), context_parallel=cp)
    sharded = shard_batch(_batches(model.config.vocab_size)["two_rows"], cp)
    with torch.no_grad(), counting_collectives() as count:
        model(**sharded)
    rows, tokens = sharded["seq_idx"].shape
    ulysses = cp.heads.size if cp.heads is not None else 1
    per_layer = [cost.elements_sent(m, rows * tokens, rows, cp.mode, cp.size, ulysses, state_pass)
                 for m in cost.mixers_of(model.config)]
    return {"measured": count["elements"], "formula": sum(e for e, _ in per_layer),
            "collectives": count["collectives"], "collectives_formula": sum(c for _, c in per_layer)}


def two_state_passes() -> dict:
    """Two models on one group, one patched with each state-pass schedule, used in turn: each runs its own (a
    regression: both were installed under one global name, so the model patched first ran the second's group and
    refused its own batches). Figures: the largest logits difference of each against one process."""
    import compilepack
    from compilepack.distributed import ContextParallel, shard_batch

    base = _build("qwen3_next")
    reference = compilepack.patch(copy.deepcopy(base))
    batch = _batches(base.config.vocab_size)["row"]
    expected = reference(**batch).logits.detach()
    errors = {}
    models = {}
    for schedule in ("sequential", "log"):
        cp = ContextParallel.sequence_parallel(dist.group.WORLD, state_pass=schedule)
        models[schedule] = (compilepack.patch(copy.deepcopy(base), context_parallel=cp), cp)
    for schedule, (model, cp) in models.items():
        with torch.no_grad():
            logits = model(**shard_batch(batch, cp)).logits
        errors[schedule] = (_gather_tokens(logits, batch["input_ids"].shape[1]) - expected).abs().max().item()
    return errors


# ------------------------------------------------------------------------------------------------ refusals


def refusals() -> dict:
    """What the new modes refuse, with its message; and what they accept that Ulysses refuses (3 query heads)."""
    import compilepack
    from compilepack.distributed import ContextParallel, shard_batch
    from tests.distributed.worker import _error
    from tests.models import hf_batch, random_docs

    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    sequence = context_parallel("sequence")
    llama = _build("llama")
    batch = hf_batch(random_docs(llama.config.vocab_size, ROW_LENGTHS, seed=1))
    ulysses_model = compilepack.patch(copy.deepcopy(llama), context_parallel=dist.group.WORLD)
    three_heads = dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    return {
        "unknown_state_pass": _error(lambda: ContextParallel.sequence_parallel(dist.group.WORLD, state_pass="ring")),
        "hybrid_mesh_names": _error(lambda: ContextParallel.hybrid(
            init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp")))),
        "hybrid_heads": _error(lambda: compilepack.patch(_build("llama", **three_heads),
                                                         context_parallel=context_parallel("hybrid"))),
        "sharded_for_other_mode": _error(lambda: ulysses_model(**shard_batch(batch, sequence))),
        "sequence_accepts_three_heads": _error(lambda: compilepack.patch(_build("llama", **three_heads),
                                                                         context_parallel=sequence)),
    }


# ------------------------------------------------------------------------------------------------ the docs' table


def report(results_folder: str | None = None) -> None:
    """Print docs/context-parallel-evidence.md's exactness table for the modes over tokens (the worst batch of each
    family, mode and W; controls: the smallest): ``python -m tests.distributed.sequence_worker`` (about 8 minutes on 2
    cores), or ``python -m tests.distributed.sequence_worker FOLDER`` from the figures the cp8 stage kept there
    (``COMPILEPACK_CP_RESULTS=FOLDER``)."""
    import tempfile
    from pathlib import Path

    from tests.distributed import worker
    from tests.distributed.test_sequence_parallel import ATTENTION_ONLY, FAMILIES, FEW_HEADS

    print("| family | W | mode | logits max abs error | loss rel. error | gradient rel. error | control: no state "
          "pass / halo (or slice alone) | control: no gradient sum |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for world in (2, 4, 8):
        if results_folder:
            results = {}
            for path in sorted(Path(results_folder).glob(f"world{world}-*.json")):
                results.update(json.loads(path.read_text()))
        else:
            checks = [("sequence_worker.family_equality", f, mode) for f in FAMILIES
                      for mode in (("sequence",) if world == 2 else ("sequence", "hybrid"))]
            checks += [("sequence_worker.family_equality", f, "sequence", "few") for f in FEW_HEADS if world > 2]
            with tempfile.TemporaryDirectory() as scratch:
                results = worker.spawn(world, checks, Path(scratch))
        for key, layouts in sorted(results.items()):
            if not key.startswith("sequence_worker.family_equality:"):
                continue
            _, family, mode, *few = key.split(":")
            control = "control_local" if family in ATTENTION_ONLY else "control_no_pass"
            worst = {k: max(f[k] for f in layouts.values()) for k in ("logits", "loss", "grads")}
            least = {k: min(f[k] for f in layouts.values()) for k in (control, "control_grads")}
            label = f"{family} (2 q heads, 1 kv head)" if few else family
            mode = mode if mode == "sequence" else f"hybrid 2 x {world // 2}"
            print(f"| {label} | {world} | {mode} | {worst['logits']:.1e} | {worst['loss']:.1e} | "
                  f"{worst['grads']:.1e} | {least[control]:.2f} | {least['control_grads']:.2f} |")


if __name__ == "__main__":
    report(*sys.argv[1:2])
