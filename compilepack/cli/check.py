"""``python -m compilepack check MODEL``: is packing exact and compile-clean for *this* model?

MODEL is a compilepack family name (its benchmark model), a local checkpoint directory, its ``config.json``, or a
hub id (read only when the hub is reachable). By default the model is built from its config with random weights
and one decoder layer of each kind the config has (``--layers N``, ``--full``), so a large config checks in
seconds on a CPU; ``--weights`` loads the checkpoint's weights (safetensors only unless ``--allow-pickle``). Code
from a checkpoint runs only with ``--trust-remote-code``. The model is patched unless ``--stock`` (then the check
is a leak detector for stock transformers, or for another library's patches applied to it).

The checks are :mod:`compilepack.testing`'s: packed == each document alone (logits and gradients), bit-exact
isolation, one graph / no break / one compile, bf16 autocast within 2x the model's own bf16 error, refusal of
malformed batches (the model refuses each, or runs it exactly). Prints a table and a verdict, writes ``--json``
(creating its folder), and exits 0 when every check passes, 1 when one fails, 2 when the model cannot be read or
built (a one-paragraph message on stderr says which file and how to fix it) or the report cannot be written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .. import testing
from ..errors import UnsupportedModelError
from ..testing.results import describe_error, guarded

CHECKS = tuple(testing.CHECK_NAMES)  # the short keys of --checks; results carry the full names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="family name (llama, qwen3_5, ...), checkpoint directory, config.json or hub id")
    depth = parser.add_mutually_exclusive_group()
    depth.add_argument("--layers", type=int, help="keep the first N decoder layers (default: one of each kind)")
    depth.add_argument("--full", action="store_true", help="keep every decoder layer")
    parser.add_argument("--weights", action="store_true", help="load the checkpoint's weights (safetensors only)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="with --weights, also load pickled (.bin) weights: they can run code when loaded")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the checkpoint's own modeling code (auto_map); never done without this flag")
    parser.add_argument("--stock", action="store_true", help="do not patch: check the model as it is (leak detector)")
    parser.add_argument("--inputs", choices=("boundaries", "position_ids"), default="boundaries",
                        help="packed batches carry the collator's boundary kwargs (default) or position_ids only "
                             "(DataCollatorWithFlattening() without return_flash_attn_kwargs)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    parser.add_argument("--backend", default="eager", choices=("eager", "aot_eager", "inductor"),
                        help="torch.compile backend of the compile stream (eager: dynamo only, fast)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        wanted = _wanted_checks(args.checks)
        _prepare_report(args.json)
        model, described = load_model(args)
    except (CheckSetupError, testing.ConfigError) as error:
        print(f"compilepack check: {error}", file=sys.stderr)
        return 2
    print(f"compilepack check {args.model}: {described}; torch {torch.__version__}")
    model, unsupported = (model, None) if args.stock else _patched(model)
    if unsupported:
        print(f"not supported: {unsupported}")
        print("The stock model's own packing, position_ids only (what it infers boundaries from):")
        args.inputs, wanted = "position_ids", ["packed", "isolation"]
    results = run_checks(model, wanted, position_ids_only=args.inputs == "position_ids", backend=args.backend,
                         seed=args.seed)
    passed = not unsupported and all(r.passed for r in results)
    print(format_table(results))
    print(verdict(results, unsupported, args))
    if args.json:
        try:
            _write_json(args, described, results, passed, unsupported, time.monotonic() - started)
        except OSError as error:
            print(f"compilepack check: cannot write the report to {args.json} ({describe_error(error)}); the table "
                  "above is the result. Choose a writable path for --json.", file=sys.stderr)
            return 2
    return 0 if passed else 1


def _wanted_checks(names: str) -> list[str]:
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(CHECKS))
    if unknown or not wanted:
        raise CheckSetupError(f"unknown checks {unknown or names!r}; choose from {', '.join(CHECKS)}.")
    return wanted


def _prepare_report(path: str | None) -> None:
    """Create the --json report's folder before any check runs: a bad path fails in a second, not after minutes."""
    if path is None:
        return
    if Path(path).is_dir():
        raise CheckSetupError(f"--json {path} is a folder: give the report's file name, e.g. "
                              f"{Path(path) / 'report.json'}.")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckSetupError(f"--json {path}: cannot create its folder ({describe_error(error)}); choose a "
                              "writable path.") from error


def _patched(model) -> tuple[torch.nn.Module, str | None]:
    """(the patched model, None), or (the stock model, why compilepack does not patch it)."""
    import compilepack

    try:
        return compilepack.patch(model), None
    except UnsupportedModelError as error:
        return model, str(error)


class CheckSetupError(Exception):
    """The model could not be read or built (exit code 2): the message says what to do."""


# ------------------------------------------------------------------------------------------------------ the model


def load_model(args) -> tuple[torch.nn.Module, str]:
    """The model to check and a one-line description of what was built. Raises :class:`testing.ConfigError` or
    :class:`CheckSetupError` (exit code 2) when the config cannot be read or the model cannot be built."""
    config, source = testing.load_config(args.model, trust_remote_code=args.trust_remote_code)
    full_layers = config.get_text_config().num_hidden_layers
    builder = testing.causal_lm_builder(args.trust_remote_code)
    try:
        if not args.full:
            # with real weights, a prefix of the layers: weights are loaded by layer index
            config = testing.reduced_config(config, args.layers, builder=builder, prefix=args.weights)
        torch.manual_seed(args.seed)
        model = _from_pretrained(source, config, args) if args.weights else builder(config)
    except (ValueError, OSError, ImportError) as error:
        hint = "" if not args.weights or args.allow_pickle else (
            " (--weights loads safetensors only; --allow-pickle also loads pickled .bin weights, which can run code "
            "when loaded)")
        raise CheckSetupError(f"cannot build {args.model}: {describe_error(error)}{hint}") from error
    model = model.float().eval()
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    layers = f"{text.num_hidden_layers} of {full_layers} layers" + (f" ({', '.join(map(str, kinds))})" if kinds else "")
    weights = "checkpoint weights" if args.weights else "random weights"
    return model, f"{type(model).__name__}, {layers}, hidden {text.hidden_size}, vocab {text.vocab_size}, {weights}"


def _from_pretrained(source: str | None, config, args) -> torch.nn.Module:
    import transformers

    if source is None:
        raise CheckSetupError("--weights needs a checkpoint directory (a family name has no weights).")
    return transformers.AutoModelForCausalLM.from_pretrained(
        source, config=config, dtype=torch.float32, trust_remote_code=args.trust_remote_code,
        use_safetensors=None if args.allow_pickle else True,  # True: refuse pickled .bin weights
    )


# ------------------------------------------------------------------------------------------------------ the checks


def run_checks(model, wanted: list[str], *, position_ids_only: bool = False, backend: str = "eager",
               seed: int = 0) -> list[testing.CheckResult]:
    """Run the named checks (``CHECKS``) on ``model``, each timed; a check that raises is a failed result."""
    wanted = _wanted_checks(",".join(wanted))
    config = model.config
    vocab = config.get_text_config().vocab_size
    batches = testing.packed_batches(vocab, chunk=testing.chunk_size_of(config), seed=seed)
    packed = testing.position_ids_only if position_ids_only else (lambda batch: batch)
    plan = {
        "packed": lambda: testing.check_packed_matches_unpacked(model, batches, packed=packed),
        "isolation": lambda: testing.check_documents_isolated(model, batches, packed=packed),
        "compile": lambda: testing.check_compiles_once(
            model, testing.varied_batches(vocab, seed=seed), backend=backend, packed=packed),
        "bf16": lambda: testing.check_bf16_close(model, batches[0], packed=packed),
        "refusal": lambda: testing.check_refuses_bad_batches(model),
    }
    results = []
    with _progress(len(wanted)) as step, _quiet_dynamo():
        for name in wanted:
            step(name)
            started = time.monotonic()
            result = _attempt(name, plan[name])
            result.values["seconds"] = round(time.monotonic() - started, 1)
            results.append(result)
    return results


@contextlib.contextmanager
def _quiet_dynamo():
    """Dynamo logs every graph break with its stack as a warning; the compile check reports the reasons itself."""
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _attempt(name: str, check: Callable[[], testing.CheckResult]) -> testing.CheckResult:
    """``check()``; the check functions never raise, but building their batches can (a model without a config)."""
    return guarded(testing.CHECK_NAMES[name], "runs", check)


class _progress:
    """A progress bar on stderr (tqdm when installed), else one line per check."""

    def __init__(self, total: int):
        self.total, self.bar, self.done = total, None, 0

    def __enter__(self):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())
        except ImportError:
            self.bar = None
        return self.step

    def step(self, name: str) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.update(self.done and 1)
            self.bar.set_description(name)
        else:
            print(f"[{self.done + 1}/{self.total}] {name} ...", file=sys.stderr, flush=True)
        self.done += 1

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------------------------ the report


def format_table(results: list[testing.CheckResult]) -> str:
    rows = [("check", "status", "figure", "threshold", "time")]
    rows += [(r.name, "pass" if r.passed else "FAIL", r.figure, r.threshold, f"{r.values.get('seconds', 0):.1f} s")
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4] for row in rows]
    for result in results:
        if not result.passed:
            lines += [f"  {result.name}: {detail}" for detail in result.details]
    return "\n".join(lines)


def verdict(results: list[testing.CheckResult], unsupported: str | None, args) -> str:
    failed = [r.name for r in results if not r.passed]
    what = "the stock model" if args.stock or unsupported else "the patched model"
    if unsupported:
        leak = "leaks between documents" if failed else "kept these documents apart"
        return f"VERDICT: not supported by compilepack; {what} {leak} with position_ids-only packing."
    if failed:
        return f"VERDICT: FAIL ({', '.join(failed)}): do not train packed on {what} as it is."
    checks = f"{len(results)} check" + ("s" if len(results) != 1 else "")
    return f"VERDICT: PASS: packing is exact and compile-clean for {what} ({checks})."


def _write_json(args, described, results, passed, unsupported, seconds) -> None:
    import transformers

    report = {
        "model": args.model, "built": described, "patched": not args.stock and not unsupported,
        "inputs": args.inputs, "passed": passed, "unsupported": unsupported, "seconds": round(seconds, 1),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "checks": [{"name": r.name, "passed": r.passed, "figure": r.figure, "threshold": r.threshold,
                    "details": r.details, "values": r.values} for r in results],
    }
    Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
