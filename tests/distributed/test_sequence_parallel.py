"""Context parallelism over tokens (sequence mode) and the hybrid layout (Ulysses inside groups of 2, sequence across
them), on CPU processes (gloo): W = 2 and 4 (one family per mixer kind, and a selection) in the main suite; every
family over tokens at W = 8 and hybrid at W = 4 (one family per mixer kind hybrid at W = 8) in the ``cp8`` stage.

Each world is one spawn (``worker.py`` running ``sequence_worker.py``'s checks) whose figures the tests assert on.
Tolerances as test_context_parallel.py: 1e-5 where only attention mixes tokens, 1e-4 with other mixers (logits
absolute; loss relative; gradients relative to the largest gradient entry, summed over the ranks); op outputs 1e-5
absolute. Every equality has its control, which must miss by far (100x the tolerance, 0.05 for gradients): the state
pass and the halo skipped (every rank's first document from a zero state, the conv reading zeros before the slice),
every rank on its slice alone (attention), a rank's gradient before the sum.

The cp8 stage: ``COMPILEPACK_CP8=1 python -m pytest -q -p no:cacheprovider -m cp8 tests/distributed`` (about 4
minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.distributed import worker

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")]

CP8 = pytest.mark.skipif(os.environ.get("COMPILEPACK_CP8") != "1",
                         reason="the cp8 stage: COMPILEPACK_CP8=1 python -m pytest -m cp8 tests/distributed")

FAMILIES = ["bamba", "falcon_h1", "granitemoehybrid", "kimi_linear", "lfm2", "lfm2_moe", "lfm3", "llama", "mistral",
            "nemotron_h", "olmo_hybrid", "qwen2", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "zamba2"]
ATTENTION_ONLY = {"llama", "mistral", "qwen2", "qwen3"}  # nothing to pass but keys: their control is the slice alone
FEW_HEADS = ["llama", "qwen3_next", "qwen3_5", "bamba"]  # 2 query heads, 1 kv head: W = 4 and 8 exceed every count
OPS = ["attention", "attention_window", "causal_conv1d", "gated_delta_rule", "kimi_delta_attention", "mamba2_scan"]
COMMUNICATION = ["llama", "qwen3_next", "bamba"]  # one family per mixer kind
# one family per mixer kind, KDA and the short conv included: each mixer's code under CP (every family runs at W = 8
# over tokens and at W = 4 hybrid in the cp8 stage: a family adds its wiring, which those cover)
MIXER_KINDS = [*COMMUNICATION, "kimi_linear", "lfm2"]
OP_TOLERANCE = 1e-5


def tolerance(family: str) -> float:
    return 1e-5 if family in ATTENTION_ONLY else 1e-4


# sequence_ops_worker.py's; the others sequence_worker.py's
OP_CHECKS = {"ops_equality", "conv_short_slices", "compile_ops"}


def _check(name: str, *args) -> tuple:
    module = "sequence_ops_worker" if name in OP_CHECKS else "sequence_worker"
    return (f"{module}.{name}", *args)


def _run(world: int, checks: list[tuple], tmp_path_factory) -> dict:
    results = worker.spawn(world, checks, tmp_path_factory.mktemp(f"sp{world}"))
    if os.environ.get("COMPILEPACK_CP_RESULTS"):  # a folder to keep the figures in (the docs' tables come from them)
        Path(os.environ["COMPILEPACK_CP_RESULTS"], f"world{world}-{len(checks)}.json").write_text(json.dumps(results))
    failed = {key: value["error"] for key, value in results.items() if "error" in value}
    assert not failed, "\n".join(f"{key}:\n{error}" for key, error in failed.items())
    return {key.split(".", 1)[1]: value for key, value in results.items()}


# ------------------------------------------------------------------------------------------------ the main suite

MAIN = {
    2: [_check("ops_equality", "sequence"), _check("refusals"), _check("compile_model", "llama", "sequence"),
        _check("two_state_passes"),
        _check("compile_ops", "sequence"), _check("conv_short_slices")]
       # W = 2 adds no code path to W = 8's (which has a first and a last rank too): every family there, in cp8
       + [_check("family_equality", f, "sequence") for f in MIXER_KINDS]
       + [_check("communication", f, "sequence") for f in COMMUNICATION],
    4: [_check("ops_equality", "sequence"), _check("ops_equality", "hybrid"),
        _check("ops_equality", "sequence", "sequential"), _check("ops_equality", "sequence", "log"),
        _check("conv_short_slices")]
       + [_check("family_equality", f, "sequence") for f in ("qwen3_next", "bamba", "kimi_linear", "lfm3")]
       + [_check("family_equality", f, "hybrid") for f in ("llama", "qwen3_5", "bamba")]
       + [_check("family_equality", f, "sequence", "few") for f in ("llama", "qwen3_5")]
       + [_check("communication", f, mode) for f in COMMUNICATION for mode in ("sequence", "hybrid")]
       + [_check("communication", "qwen3_next", "sequence", schedule) for schedule in ("sequential", "log")],
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict:
    return _run(2, MAIN[2], tmp_path_factory)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    return _run(4, MAIN[4], tmp_path_factory)


@pytest.fixture(params=[2, 4], ids=["W2", "W4"])
def results(request, world2, world4) -> dict:
    return {2: world2, 4: world4}[request.param]


def _families_in(results: dict) -> list[tuple[str, dict]]:
    return [(key, figures) for key, figures in results.items() if key.startswith("family_equality:")]


def assert_family_equals_one_process(key: str, figures: dict) -> None:
    """Logits, loss and the summed gradients equal one process's for every batch (one row with a document across
    several rank edges and a 1-token document, padded; two rows, padded; documents starting and ending at rank
    edges); the controls miss by far."""
    family = key.split(":")[1]
    tol = tolerance(family)
    for batch, f in figures.items():
        assert f["logits"] <= tol and f["loss"] <= tol and f["grads"] <= tol, (key, batch, f)
        control = f["control_local"] if family in ATTENTION_ONLY else f["control_no_pass"]
        assert control >= 100 * tol, (key, batch, f)
        assert f["control_grads"] >= 0.05, (key, batch, f)


def test_families_over_tokens_equal_one_process(results):
    """One family per mixer kind over tokens (W = 2), and a selection over tokens and hybrid, and with fewer heads
    than ranks (W = 4); every family in the cp8 stage."""
    checked = _families_in(results)
    assert checked
    for key, figures in checked:
        assert_family_equals_one_process(key, figures)


def test_fewer_heads_than_ranks(world4):
    """2 query heads and 1 kv head (Qwen3.5: 1 q/k and 2 value heads) over 4 ranks: Ulysses refuses such a model,
    the sequence mode runs it exactly."""
    for family in ("llama", "qwen3_5"):
        assert_family_equals_one_process(f"family_equality:{family}:sequence:few",
                                         world4[f"family_equality:{family}:sequence:few"])


@pytest.mark.parametrize("op", OPS)
def test_each_op_equals_the_op_on_one_process(results, op):
    """Op level, two rows of 96 tokens with documents across one and several rank edges and 1-token documents:
    output, input gradients and parameter gradients summed over the ranks; sequence mode (both state-pass schedules
    at W = 4) and hybrid. Control: the state pass or the halo skipped (attention: the slice alone)."""
    runs = [key for key in results if key.startswith("ops_equality")]
    assert runs
    for key in runs:
        figures = results[key][op]
        assert figures["output"] <= OP_TOLERANCE and figures["grads"] <= OP_TOLERANCE, (key, figures)
        assert figures["control"] >= 100 * OP_TOLERANCE, (key, figures)


def test_compiled_model_over_tokens_is_one_graph_compiled_once(world2):
    """Llama over tokens, torch.compile(fullgraph=True, dynamic=True, aot_eager) per rank, forward and backward over
    3 batches of different lengths and documents: one graph on every rank (no break, no recompile); compiled ==
    eager."""
    figures = world2["compile_model:llama:sequence"]
    assert len(figures["row_lengths"]) == figures["batches"] == 3
    assert figures["graphs"] == 1, figures
    assert figures["logits"] <= 1e-6 and figures["grads"] <= 1e-6, figures


def test_compiled_state_passes_and_halos_are_one_graph(world2):
    """Conv (halo), gated delta rule, KDA and Mamba2 scan (state passes) over tokens in one compiled function, the
    boundaries among its inputs, forward + backward over 3 batches of two rows: one graph on every rank."""
    figures = world2["compile_ops:sequence"]
    assert figures["graphs"] == 1, figures
    assert figures["compiled_vs_eager"] <= 1e-6, figures


def test_communication_follows_the_documented_formulas(results):
    """Elements a rank sends in one forward, counted at every collective (all-to-all, shift, all-gather), equal
    compilepack.distributed.cost's formulas (docs/context-parallel-evidence.md), as do the collectives it waits on."""
    runs = [key for key in results if key.startswith("communication:")]
    assert runs
    for key in runs:
        figures = results[key]
        assert figures["measured"] == figures["formula"] > 0, (key, figures)
        assert figures["collectives"] == figures["collectives_formula"], (key, figures)


def test_the_log_depth_schedule_sends_more_at_four_ranks(world4):
    """At W = 4 the log-depth state pass sends more than the sequential one (the [K, K] transforms travel too),
    which is why "auto" picks the sequential one there."""
    sequential = world4["communication:qwen3_next:sequence:sequential"]["measured"]
    log = world4["communication:qwen3_next:sequence:log"]["measured"]
    assert log > sequential == world4["communication:qwen3_next:sequence"]["measured"]


def test_conv_over_slices_shorter_than_its_window(results):
    """2 tokens per rank, convs of 4 and 7 taps: the window reaches past the previous rank, so every slice is
    gathered; equal to one process; the slice alone misses by far."""
    for taps, figures in results["conv_short_slices"].items():
        assert figures["output"] <= OP_TOLERANCE and figures["grads"] <= OP_TOLERANCE, (taps, figures)
        assert figures["control"] >= 100 * OP_TOLERANCE, (taps, figures)


REFUSALS = {
    "unknown_state_pass": "state_pass must be one of ('auto', 'sequential', 'log'), got 'ring'",
    "hybrid_mesh_names": "needs a 2-D DeviceMesh with dimensions named ('sequence', 'ulysses')",
    "hybrid_heads": "num_attention_heads=3 does not divide by the context-parallel size 2",
    "sharded_for_other_mode": "the batch was sharded for sequence(size=2",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_problem(world2, case):
    message = world2["refusals"][case]
    assert message.startswith("ContextParallelError: "), message
    assert REFUSALS[case] in message, message


def test_models_patched_with_different_state_passes_each_run_their_own(world2):
    """One group, a model patched with each schedule, run in turn: both equal one process (the one patched first
    used to run the other's group and refuse its own batches)."""
    errors = world2["two_state_passes"]
    assert set(errors) == {"sequential", "log"} and max(errors.values()) <= 1e-4, errors


def test_sequence_mode_accepts_heads_ulysses_refuses(world2):
    """3 query heads over 2 ranks: Ulysses refuses it (test_context_parallel.py), the sequence mode patches it."""
    assert world2["refusals"]["sequence_accepts_three_heads"] == "no error"


# ------------------------------------------------------------------------------------------------ the cp8 stage

STAGE = {
    2: [_check("communication", f, "sequence", s) for f in COMMUNICATION for s in ("sequential", "log")],
    # W = 4 over tokens adds no code path to W = 8's (first, middle and last ranks, documents over several slices):
    # every family over tokens at 8; at 2 and 4, the main suite's one family per mixer kind. Hybrid: every family at
    # 4 (2 x 2); at 8 (2 x 4: middle sequence ranks, which over tokens every family has) one per mixer kind
    # Compiled at W = 4 (W = 2 in the main suite): each rank traces its own graph, the rank and W constants in it;
    # over tokens W = 4 adds the middle ranks W = 2 lacks, and the ops run the log-depth state pass (W = 8's default)
    # there. At W = 8 (until 2026-12-06) the same traces took 183 s of the stage: 8 processes tracing on 2 cores
    4: [_check("family_equality", f, "hybrid") for f in FAMILIES]
       + [_check("family_equality", f, "sequence", "few") for f in FEW_HEADS]
       + [_check("compile_model", "llama", mode) for mode in ("sequence", "hybrid")]
       + [_check("compile_ops", "sequence", "log"), _check("compile_ops", "hybrid")],
    8: [_check("ops_equality", "sequence"), _check("ops_equality", "hybrid"),
        _check("ops_equality", "sequence", "sequential"), _check("conv_short_slices")]
       + [_check("family_equality", f, "sequence") for f in FAMILIES]
       + [_check("family_equality", f, "hybrid") for f in MIXER_KINDS]
       + [_check("family_equality", f, mode, "few") for f in FEW_HEADS for mode in ("sequence", "hybrid")]
       + [_check("communication", f, mode) for f in COMMUNICATION for mode in ("sequence", "hybrid")]
       + [_check("communication", f, "sequence", "sequential") for f in COMMUNICATION],
}


@pytest.fixture(scope="module")
def stage(tmp_path_factory) -> dict:
    return {world: _run(world, checks, tmp_path_factory) for world, checks in STAGE.items()}


@CP8
@pytest.mark.cp8
@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_cp8_every_family_equals_one_process(stage, world):
    """Every family CP covers: over tokens at W = 8, hybrid at W = 4 (2 x 2); one per mixer kind hybrid at W = 8
    (2 x 4); the fewer-heads configs (2 query heads, 1 kv head) at W = 4 and 8, where W exceeds every head count."""
    checked = _families_in(stage[world])
    expected = {4: len(FAMILIES) + len(FEW_HEADS), 8: len(FAMILIES) + len(MIXER_KINDS) + 2 * len(FEW_HEADS)}[world]
    assert len(checked) == expected
    for key, figures in checked:
        assert_family_equals_one_process(key, figures)


@CP8
@pytest.mark.cp8
@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
def test_cp8_each_op_equals_the_op_on_one_process(stage, op):
    for key in (k for k in stage[8] if k.startswith("ops_equality")):
        figures = stage[8][key][op]
        assert figures["output"] <= OP_TOLERANCE and figures["grads"] <= OP_TOLERANCE, (key, figures)
        assert figures["control"] >= 100 * OP_TOLERANCE, (key, figures)


@CP8
@pytest.mark.cp8
@pytest.mark.slow
def test_cp8_conv_over_slices_shorter_than_its_window(stage):
    test_conv_over_slices_shorter_than_its_window(stage[8])


@CP8
@pytest.mark.cp8
@pytest.mark.slow
def test_cp8_compiled_is_one_graph_per_rank(stage):
    """Llama and the linear mixers' ops, compiled (fullgraph, dynamic, aot_eager) at W = 4: over tokens (first,
    middle and last ranks; the ops with the log-depth state pass) and hybrid (2 x 2): one graph on every rank over 3
    batches; compiled == eager."""
    for mode in ("sequence", "hybrid"):
        figures = stage[4][f"compile_model:llama:{mode}"]
        assert figures["graphs"] == 1 and figures["logits"] <= 1e-6 and figures["grads"] <= 1e-6, (mode, figures)
    for key in ("compile_ops:sequence:log", "compile_ops:hybrid"):
        figures = stage[4][key]
        assert figures["graphs"] == 1 and figures["compiled_vs_eager"] <= 1e-6, (key, figures)


@CP8
@pytest.mark.cp8
@pytest.mark.slow
def test_cp8_communication_follows_the_documented_formulas(stage):
    runs = [(world, key) for world in stage for key in stage[world] if key.startswith("communication:")]
    assert len(runs) == 6 + 9
    for world, key in runs:
        figures = stage[world][key]
        assert figures["measured"] == figures["formula"] > 0, (world, key, figures)
        assert figures["collectives"] == figures["collectives_formula"], (world, key, figures)
