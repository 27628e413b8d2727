"""``python -m compilepack``: ``check MODEL`` (is packing exact and compile-clean for a model?) and ``explain
<family>`` (stock next to patched). The benchmark is not here: it is the checkout's ``benchmarks/`` package
(``python -m benchmarks``, docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import copy
import random
import sys

import torch

from .. import patching
from ..testing.explain import count_compiles, explain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compilepack", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    explain_parser = commands.add_parser("explain", help="graphs, breaks, recompiles and correctness: stock vs patched")
    explain_parser.add_argument("family", help="model family, e.g. llama, qwen3_next, qwen3_5, bamba")
    explain_parser.add_argument("--batches", type=int, default=10, help="batches in the recompile count")
    explain_parser.add_argument(
        "--lora", action="store_true",
        help="both models wrapped in PEFT LoRA (every linear layer but the LM head) with gradient checkpointing on, "
             "as TRL's LoRA recipe trains them; the forward is counted in train mode, as a trainer compiles it")
    explain_parser.set_defaults(run=_explain_command)

    check_parser = commands.add_parser(
        "check", help="is packing exact and compile-clean for this model? (see docs/checking.md)",
        description="Packed == each document alone, isolation, one graph / one compile, bf16, refusal of bad "
                    "batches, on a model built from a family name, checkpoint directory or config.json.")
    from .check import add_arguments as add_check_arguments

    add_check_arguments(check_parser)
    check_parser.set_defaults(run=_check_command)

    args = parser.parse_args(argv)
    return args.run(args)


def _check_command(args) -> int:
    from .check import run

    return run(args)


def _explain_command(args) -> int:
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

    family = patching.family_named(args.family)
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(family.bench_config()).eval()
    patched = patching.patch(copy.deepcopy(stock))
    if args.lora:
        stock, patched = _with_lora(stock), _with_lora(patched)  # patched first: its hook comes guarded
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    vocab = stock.config.get_text_config().vocab_size
    docs = _documents(vocab, [70, 1, 23, 5, 40], seed=0)
    batch = collate([{"input_ids": d} for d in docs])
    stream = [collate([{"input_ids": d} for d in _documents(vocab, _lengths(i), seed=i)]) for i in range(args.batches)]

    lora = "; PEFT LoRA + gradient checkpointing, forward in train mode" if args.lora else ""
    print(f"compilepack explain {family.name} (the benchmark's model, {stock.config.num_hidden_layers} layers; "
          f"HF DataCollatorWithFlattening batches; torch {torch.__version__}{lora})")
    header = (f"{'':8} {'forward':>16} {'forward+backward':>18} {'compiles/' + str(args.batches) + ' batches':>20} "
              f"{'max |packed - alone| logit':>28}")
    print(header)
    reasons = {}
    for name, model in (("stock", stock), ("patched", patched)):
        row, reasons[name] = _explain_row(model, batch, stream, docs, forward_in_train_mode=args.lora)
        print(f"{name:8} {row[0]:>16} {row[1]:>18} {row[2]:>20} {row[3]:>28}")
    for name, lines in reasons.items():
        for line in lines:
            print(f"  {name}: {line}")
    return 0


def _with_lora(model):
    """``model`` as TRL's LoRA recipe trains it: LoRA adapters, non-reentrant gradient checkpointing, whose
    ``enable_input_require_grads`` hook is what a trainer's compile meets (compilepack.patch guards it)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise SystemExit("compilepack explain --lora needs PEFT: pip install peft") from error
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    lora.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return lora


def _explain_row(model, batch, stream, docs, forward_in_train_mode: bool = False):
    notes = []
    cells = []
    for backward in (False, True):
        model.train(backward or forward_in_train_mode)
        cells.append(_attempt(lambda: _graphs(explain(model, batch, backward=backward, reset=True), notes), notes))
    model.eval()
    cells.append(_attempt(lambda: str(count_compiles(model, stream, dynamic=True, reset=True).compiles), notes))
    cells.append(_attempt(lambda: f"{_max_logit_diff(model, batch, docs):.2e}", notes))
    return cells, list(dict.fromkeys(notes))


def _graphs(report, notes) -> str:
    notes.extend(f"break: {reason}" for reason in report.break_reasons)
    return f"{report.graphs} graph, {report.graph_breaks} brk"


def _attempt(cell, notes) -> str:
    try:
        return cell()
    except Exception as error:  # the stock model may refuse a packed batch: show it, do not stop
        notes.append(f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
        return type(error).__name__


def _max_logit_diff(model, batch, docs) -> float:
    with torch.no_grad():
        packed = model(**batch).logits[0]
        cu = batch["cu_seq_lens_q"].tolist()
        return max(
            (packed[s:e] - model(input_ids=torch.tensor([d]), use_cache=False).logits[0]).abs().max().item()
            for s, e, d in zip(cu[:-1], cu[1:], docs)
        )


def _lengths(seed: int) -> list[int]:
    generator = random.Random(1000 + seed)
    return [generator.randint(1, 150) for _ in range(generator.randint(1, 6))]


def _documents(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(1, vocab) for _ in range(n)] for n in lengths]


if __name__ == "__main__":
    sys.exit(main())
