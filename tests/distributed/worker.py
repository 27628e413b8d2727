"""Spawned side of the context-parallel tests: W CPU processes (gloo, file rendezvous) run a list of checks and rank 0
returns each check's figures to the test process (a JSON file). One spawn per group size runs many checks, since
starting processes costs seconds on 2 cores.

Every check runs on every rank (they all take part in the collectives) and returns plain numbers; the tests in
test_context_parallel.py assert on them.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).absolute().parents[2]

# one packed row of 129 tokens: a 70-token document (longer than the mixers' 64-token chunk) straddles the rank
# splits for W = 2 and 4, a 1-token document, and 129 divides by neither 2 nor 4 (a padding document is added)
ROW_LENGTHS = [70, 1, 23, 5, 30]
# two rows of a PackedCollator(max_length=64, flatten=False) batch: rows of 61 tokens (padding document in row 1)
TWO_ROW_LENGTHS = [40, 30, 20, 15, 1]


def spawn(world: int, checks: list[tuple], out: Path) -> dict:
    """Run ``checks`` (``(name, *args)``) on ``world`` processes; rank 0's figures by check."""
    import torch.multiprocessing as mp

    rendezvous = out / "rendezvous"
    mp.spawn(_main, (world, checks, str(rendezvous), str(out)), nprocs=world, join=True)
    return json.loads((out / "results.json").read_text())


def _main(rank: int, world: int, checks: list[tuple], rendezvous: str, out: str) -> None:
    sys.path.insert(0, str(REPO))
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    results, seconds = {}, {}
    try:
        for name, *args in checks:
            key = ":".join([name, *map(str, args)])
            start = time.perf_counter()
            try:
                results[key] = _check(name)(*args)
            except Exception:  # one failing check should not hide the others' figures
                results[key] = {"error": traceback.format_exc()}
            torch._dynamo.reset()
            seconds[key] = round(time.perf_counter() - start, 2)
        if rank == 0:
            Path(out, "results.json").write_text(json.dumps(results, indent=1))
            # what each check cost (rank 0's wall clock), to choose what a stage runs; no test reads it
            Path(out, "seconds.json").write_text(json.dumps(seconds, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check(name: str):
    """A check of this module, or ``module.function`` of a sibling module (``tests/distributed/<module>.py``)."""
    if "." not in name:
        return globals()[name]
    import importlib

    module, function = name.rsplit(".", 1)
    return getattr(importlib.import_module(f"tests.distributed.{module}"), function)


# ------------------------------------------------------------------------------------------------ helpers


def _world():
    return dist.group.WORLD


def _gather_tokens(local: torch.Tensor, length: int, group=None) -> torch.Tensor:
    """The whole rows ``[R, length, ...]`` from every rank's ``[R, T_local, ...]`` slice (padding cut off)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=1)[:, :length]


# Under dynamic=True every size of a compiled function's inputs is symbolic. A model's heads, widths and parameters are
# static (dynamo keeps parameters static), and symbolic ones make each head split of the all-to-alls a sympy proof:
# several times the tracing time (measured: the hybrid ops at W = 4, 128 s against 36). The op-level compile checks
# mark them so, leaving the tokens (and the boundaries' sizes) dynamic as in a model.


def only_tokens_dynamic(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``[rows, tokens, ...]``) with every dimension but the tokens static to the compiler."""
    for dim in range(tensor.dim()):
        if dim != 1:
            torch._dynamo.mark_static(tensor, dim)
    return tensor


def static(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with every dimension static to the compiler (a parameter's)."""
    torch._dynamo.mark_static(tensor)
    return tensor


def _summed_grads(model: torch.nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient summed over the ranks: one all-reduce of them all, flattened (one collective per
    parameter costs more than the step at W = 8 on 2 cores)."""
    grads = _grads(model)
    flat = torch.cat([grad.flatten() for grad in grads.values()])
    dist.all_reduce(flat, group=group)
    parts = flat.split([g.numel() for g in grads.values()])
    return {name: part.view_as(grads[name]) for name, part in zip(grads, parts)}


def one_process_step(model: torch.nn.Module, batch: dict) -> types.SimpleNamespace:
    """The one-process reference of a check: forward + backward of the whole batch, run on rank 0 only and
    broadcast, so every rank compares with the same logits and loss and finds the same gradients in ``.grad``; the
    other W - 1 ranks skip the whole model's step (every rank computed it before: identical work, W times)."""
    model.zero_grad()
    parameters = dict(model.named_parameters())
    if dist.get_rank() == 0:
        out = model(**batch)
        out.loss.backward()
        logits, loss = out.logits.detach(), out.loss.detach().view(1)
        layout = [tuple(logits.shape), [name for name, p in parameters.items() if p.grad is not None]]
    else:
        layout = [None, None]
    dist.broadcast_object_list(layout, src=0)
    shape, with_grads = layout
    if dist.get_rank() != 0:
        logits, loss = torch.empty(shape), torch.empty(1)
        for name in with_grads:
            parameters[name].grad = torch.empty_like(parameters[name])
    parts = [logits, loss, *(parameters[name].grad for name in with_grads)]
    assert all(part.dtype == torch.float32 for part in parts), "the reference checks run in fp32"
    flat = torch.cat([part.flatten() for part in parts])
    dist.broadcast(flat, src=0)
    for part, values in zip(parts, flat.split([part.numel() for part in parts])):
        part.copy_(values.view_as(part))
    return types.SimpleNamespace(logits=logits, loss=loss[0])


def _max_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def _relative(grads: dict, reference: dict) -> float:
    scale = max(r.abs().max().item() for r in reference.values())
    return max((grads[n] - reference[n]).abs().max().item() for n in reference) / scale


def _batches(vocab_size: int) -> dict[str, dict]:
    from compilepack import PackedCollator
    from tests.models import hf_batch, random_docs

    two_rows = PackedCollator(max_length=64, flatten=False)
    return {
        "row": hf_batch(random_docs(vocab_size, ROW_LENGTHS, seed=1)),
        "two_rows": two_rows([{"input_ids": d} for d in random_docs(vocab_size, TWO_ROW_LENGTHS, seed=2)]),
    }


def _build(family_name: str, **config_overrides) -> torch.nn.Module:
    from compilepack.patching import family_named
    from tests.families import build_tiny, tiny_config

    torch.manual_seed(0)
    if not config_overrides:
        return build_tiny(family_named(family_name)).train()
    import transformers

    config = tiny_config(family_named(family_name))
    for key, value in config_overrides.items():
        setattr(config, key, value)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _local_batch(sharded: dict) -> dict:
    """The control: this rank's slice run as a packed batch of its own (documents cut at the slice edges), what a
    rank computes without the all-to-alls."""
    from compilepack import Boundaries

    lengths = []
    for row in sharded["seq_idx"][:, _slice(sharded)]:
        lengths += torch.unique_consecutive(row, return_counts=True)[1].tolist()
    boundaries = Boundaries.from_lengths(lengths, rows=sharded["input_ids"].shape[0])
    return {"input_ids": sharded["input_ids"], **boundaries.as_kwargs()}


def _slice(sharded: dict) -> slice:
    local = sharded["input_ids"].shape[1]
    rank = sharded["context_parallel_shard"].rank
    return slice(rank * local, (rank + 1) * local)


# ------------------------------------------------------------------------------------------------ checks


def family_equality(family_name: str) -> dict:
    """CP over the world == one process (same weights, same batch): logits, loss, every parameter's gradient,
    for a one-row batch and a two-row batch; with the controls (no all-to-all; no gradient sum)."""
    import compilepack
    from compilepack.distributed import shard_batch

    base = _build(family_name)
    reference = compilepack.patch(copy.deepcopy(base))
    parallel = compilepack.patch(copy.deepcopy(base), context_parallel=_world())
    figures = {}
    for name, batch in _batches(base.config.vocab_size).items():
        parallel.zero_grad()
        expected = one_process_step(reference, batch)
        sharded = shard_batch(batch, _world())
        out = parallel(**sharded)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        length = batch["input_ids"].shape[1]
        logits = _gather_tokens(out.logits.detach(), length)
        with torch.no_grad():
            alone = reference(**_local_batch(sharded)).logits
        padded = torch.nn.functional.pad(expected.logits.detach(), (0, 0, 0, sharded["seq_idx"].shape[1] - length))
        real = torch.arange(sharded["seq_idx"].shape[1])[_slice(sharded)] < length  # not the padding document
        figures[name] = {
            "world": dist.get_world_size(), "tokens": length, "local_tokens": sharded["input_ids"].shape[1],
            "loss": abs(loss.item() - expected.loss.item()) / expected.loss.item(),
            "logits": (logits - expected.logits).abs().max().item(),
            "grads": _relative(_summed_grads(parallel), _grads(reference)),
            "control_logits": _max_over_ranks((alone - padded[:, _slice(sharded)])[:, real].abs().max()),
            "control_grads": _relative(_grads(parallel), _grads(reference)),
        }
    return figures


def _stream(vocab_size: int) -> list[dict]:
    """Varied one-row batches: lengths and document counts change; two need a padding document (W = 2 and 4).
    (A change in the number of rows from 1 recompiles any model: dynamo specialises dimensions of size 1.)"""
    from tests.models import hf_batch, random_docs

    lengths = [[12, 40, 1, 26], [3, 50, 9, 1, 17, 33, 5], [101]]  # 79, 118 and 101 tokens
    return [hf_batch(random_docs(vocab_size, n, seed=10 + i)) for i, n in enumerate(lengths)]


def compile_check(family_name: str) -> dict:
    """torch.compile(fullgraph=True, dynamic=True, aot_eager) of the CP model per rank: graphs and compiles over a
    varied stream (forward + backward; fullgraph=True raises on any graph break), and compiled == eager for logits
    and gradients."""
    import torch._dynamo.testing

    import compilepack
    from compilepack.distributed import shard_batch

    model = compilepack.patch(_build(family_name), context_parallel=_world())
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    batches = [shard_batch(b, _world()) for b in _stream(model.config.vocab_size)]
    return {
        **compiled_against_eager(model, step, batches),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before,
        "backend_calls": counter.frame_count,
    }


def compiled_against_eager(model: torch.nn.Module, step, batches: list[dict]) -> dict:
    """Forward + backward of each sharded batch through ``step`` (the compiled model), then eager: the largest
    logits difference and relative gradient difference over the ranks."""
    logits_error, grads_error = 0.0, 0.0
    for sharded in batches:
        model.zero_grad()
        compiled = step(**sharded)
        compiled.loss.backward()
        compiled_grads = _grads(model)
        model.zero_grad()
        eager = model(**sharded)
        eager.loss.backward()
        logits_error = max(logits_error, _max_over_ranks((compiled.logits - eager.logits).abs().max()))
        grads_error = max(grads_error, _relative(compiled_grads, _grads(model)))
    return {"batches": len(batches), "row_lengths": sorted({b["seq_idx"].shape[1] for b in batches}),
            "logits": logits_error, "grads": grads_error}


def op_against_one_process(cp_call, full_call, inputs: list, params: list, local: slice) -> dict:
    """One op on whole rows (``full_call``) and on this rank's slice ``local`` of them (``cp_call``, parameters
    replicated and their gradients summed over the ranks), against a random weighting of the output: ``output``
    and ``grads`` (relative to the largest gradient entry) over the ranks, and what the control needs (``mine``,
    ``my_params``: the slice's inputs; ``expected``: the whole rows' output, this rank's part)."""
    inputs = [x.requires_grad_() for x in inputs]
    params = [p.requires_grad_() for p in params]
    expected = full_call(*inputs, *params)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    (expected * weights).sum().backward()
    mine = [x.detach()[:, local].clone().requires_grad_() for x in inputs]
    my_params = [p.detach().clone().requires_grad_() for p in params]
    out = cp_call(*mine, *my_params)
    (out * weights[:, local]).sum().backward()
    for p in my_params:
        dist.all_reduce(p.grad)
    scale = max(t.grad.abs().max().item() for t in inputs + params)
    grads = [(m.grad - x.grad[:, local]).abs().max() for m, x in zip(mine, inputs)]
    grads += [(m.grad - p.grad).abs().max() for m, p in zip(my_params, params)]
    return {
        "output": _max_over_ranks((out - expected[:, local]).abs().max()),
        "grads": _max_over_ranks(torch.stack(grads).max()) / scale,
        "mine": mine, "my_params": my_params, "expected": expected[:, local].detach(),
    }


# ------------------------------------------------------------------------------------------------ refusals


def _error(call) -> str:
    try:
        call()
    except Exception as error:  # the tests assert on the type and message
        return f"{type(error).__name__}: {error}"
    return "no error"


def refusals() -> dict:
    """What must be refused, with its message: heads or groups that cannot be split over the group, batches not
    sharded (or sharded for another group) for the model, ranks holding different batches, a non-CP model given a
    sharded batch."""
    import compilepack
    from compilepack.distributed import shard_batch
    from tests.models import hf_batch, random_docs

    world = dist.get_world_size()
    other_group = dist.new_group(list(range(world)))  # the same ranks, another group
    llama = _build("llama")
    batch = hf_batch(random_docs(llama.config.vocab_size, ROW_LENGTHS, seed=1))
    parallel = compilepack.patch(copy.deepcopy(llama), context_parallel=_world())
    plain = compilepack.patch(copy.deepcopy(llama))
    different = hf_batch(random_docs(llama.config.vocab_size, ROW_LENGTHS, seed=1 + dist.get_rank()))
    return {
        "indivisible_heads": _error(lambda: compilepack.patch(
            _build("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=3), context_parallel=_world())),
        "indivisible_groups": _error(lambda: compilepack.patch(
            _build("bamba", hidden_size=96, mamba_n_heads=6, mamba_n_groups=3, mamba_d_head=32),
            context_parallel=_world())),
        "indivisible_channels": _error(lambda: _conv_with_channels(world + 1)),
        "unsupported_family": _error(lambda: compilepack.patch(_build("mamba"), context_parallel=_world())),
        "unsharded_batch": _error(lambda: parallel(**batch)),
        "sharded_for_plain_model": _error(lambda: plain(**shard_batch(batch, _world()))),
        "sharded_for_other_group": _error(lambda: parallel(**shard_batch(batch, other_group))),
        "different_batches": _error(lambda: shard_batch(different, _world())),
        "two_dimensional_mesh": _error(lambda: compilepack.patch(copy.deepcopy(llama), context_parallel=_mesh_2d())),
    }


def _conv_with_channels(channels: int):
    from compilepack.distributed import ContextParallel
    from compilepack.ops.causal_conv1d.sharded import causal_conv1d_head_parallel

    cp = ContextParallel.of(_world())
    total = 4 * cp.size
    x = torch.randn(1, channels, total // cp.size)
    seq_idx = torch.zeros(1, total, dtype=torch.int32)
    return causal_conv1d_head_parallel(x, torch.randn(channels, 4), None, seq_idx, None, backend="reference", cp=cp)


def _mesh_2d():
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh("cpu", (world // 2, 2))


# ------------------------------------------------------------------------------------------------ CP x FSDP2


def fsdp_equality(family_name: str) -> dict:
    """2 data-parallel replicas x CP over 2 ranks on 4 processes, parameters sharded by FSDP2 over all 4: the
    gradients equal one process's gradient of the mean of the two replicas' losses. FSDP2 averages over its 4
    ranks, so each rank's loss share is scaled by the CP size (2)."""
    import compilepack
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compilepack.distributed import shard_batch
    from tests.models import hf_batch, random_docs

    rank, world, cp_size = dist.get_rank(), dist.get_world_size(), 2
    cp_group = init_device_mesh("cpu", (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))["cp"]  # a 1-D mesh
    base = _build(family_name)
    batches = [hf_batch(random_docs(base.config.vocab_size, n, seed=s))
               for s, n in enumerate([ROW_LENGTHS, [12, 40, 66]])]
    reference = compilepack.patch(copy.deepcopy(base))
    (sum(reference(**b).loss for b in batches) / len(batches)).backward()
    model = compilepack.patch(copy.deepcopy(base), context_parallel=cp_group)  # patch first, then shard
    everyone = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=everyone)
    fully_shard(model, mesh=everyone)
    sharded_parameters = all(type(p).__name__ == "DTensor" for p in model.parameters())
    (model(**shard_batch(batches[rank // cp_size], cp_group)).loss * cp_size).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    one_replica = compilepack.patch(copy.deepcopy(base))
    one_replica(**batches[0]).loss.backward()
    return {"grads": _relative(grads, _grads(reference)), "sharded": sharded_parameters,
            "control_one_replica": _relative(_grads(one_replica), _grads(reference))}


# ------------------------------------------------------------------------------------------------ communication


def _elements_per_token(config, kind: str, world: int) -> int:
    """docs/context-parallel-evidence.md's ``e``: elements per token a mixer exchanges (inputs and output), forward."""
    if kind == "attention":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 2 * config.num_attention_heads * head_dim + 2 * max(config.num_key_value_heads, world) * head_dim
    if kind == "gated_deltanet":
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        qk = 2 * max(config.linear_num_key_heads, world) * config.linear_key_head_dim
        return 2 * (2 * key_dim + value_dim) + qk + 2 * value_dim + 2 * config.linear_num_value_heads
    inner = config.mamba_expand * config.hidden_size  # Mamba2
    groups, state = config.mamba_n_groups, config.mamba_d_state
    conv_dim = inner + 2 * groups * state
    return 2 * conv_dim + 2 * inner + config.mamba_n_heads + 2 * max(groups, world) * state


def _layer_kinds(family_name: str, config) -> list[str]:
    if family_name == "bamba":
        return ["attention" if i in config.attn_layer_indices else "mamba2" for i in range(config.num_hidden_layers)]
    if family_name == "llama":
        return ["attention"] * config.num_hidden_layers
    return ["attention" if t == "full_attention" else "gated_deltanet" for t in config.layer_types]


def communication(family_name: str) -> dict:
    """Elements this rank sends to the others in one forward (every all-to-all counted as it runs) against the
    formula ``sum over layers of (W - 1) / W^2 x T x e``."""
    import compilepack
    from compilepack.distributed import collectives, shard_batch

    model = compilepack.patch(_build(family_name), context_parallel=_world())
    world = dist.get_world_size()
    sent = []
    exchange = collectives.all_to_all

    def counting(send, cp):
        sent.append(send.numel() * (cp.size - 1) // cp.size)  # the rank's own chunk stays
        return exchange(send, cp)

    sharded = shard_batch(_batches(model.config.vocab_size)["row"], _world())
    collectives.all_to_all = counting
    try:
        with torch.no_grad():
            model(**sharded)
    finally:
        collectives.all_to_all = exchange
    tokens = sharded["seq_idx"].numel()
    kinds = _layer_kinds(family_name, model.config)
    expected = sum((world - 1) * tokens * _elements_per_token(model.config, k, world) // world**2 for k in kinds)
    return {"measured": sum(sent), "formula": expected, "all_to_alls": len(sent), "layers": kinds}


# ------------------------------------------------------------------------------------------------ the docs' table


def report(families: tuple[str, ...] = ("llama", "qwen3_next", "qwen3_5", "bamba")) -> None:
    """Print docs/context-parallel-evidence.md's equality table (worst of the two layouts):
    ``python tests/distributed/worker.py``."""
    import tempfile

    print("| family | W | logits | loss rel. | gradients rel. | control: no all-to-all | control: no gradient sum |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = {}
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as scratch:
            results = spawn(world, [("family_equality", f) for f in families], Path(scratch))
        for family in families:
            layouts = results[f"family_equality:{family}"].values()
            worst = {key: max(f[key] for f in layouts) for key in ("logits", "loss", "grads")}
            least = {key: min(f[key] for f in layouts) for key in ("control_logits", "control_grads")}
            rows[family, world] = (
                f"| {family} | {world} | {worst['logits']:.1e} | {worst['loss']:.1e} | {worst['grads']:.1e} | "
                f"{least['control_logits']:.2f} | {least['control_grads']:.2f} |"
            )
    print("\n".join(rows[family, world] for family in families for world in (2, 4)))


if __name__ == "__main__":
    report()
