"""Context parallelism (Ulysses) on CPU processes (gloo): CP over W = 2 and 4 ranks equals one process.

Two spawned runs (``worker.py``: one per group size, every check batched into it, since starting processes costs
seconds on 2 cores) return figures; the tests assert on them. Tolerances as the family tests: 1e-5 when only
attention mixes tokens, 1e-4 with other mixers (logits absolute; gradients relative to the largest gradient entry,
summed over the CP ranks). Every equality has its control: the same rank without the all-to-alls (its slice run as
a packed batch of its own: documents straddling the split lose their beginning), or its gradient without the sum
over ranks, must miss by far.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed import worker

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")]

FAMILIES = ["llama", "qwen3_next", "qwen3_5", "bamba"]
TOLERANCE = {"llama": 1e-5, "qwen3_next": 1e-4, "qwen3_5": 1e-4, "bamba": 1e-4}
OPS = ["attention", "causal_conv1d", "gated_delta_rule", "mamba2_scan"]
OP_TOLERANCE = 1e-5
COMMUNICATION = ["llama", "qwen3_next", "bamba"]  # one family per mixer kind


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict:
    checks = [("family_equality", f) for f in FAMILIES] + [("communication", f) for f in COMMUNICATION]
    checks += [("ops_worker.ops_equality",), ("refusals",), ("compile_check", "llama"), ("ops_worker.ops_compile",)]
    return _no_errors(worker.spawn(2, checks, tmp_path_factory.mktemp("cp2")))


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    checks = [("family_equality", f) for f in FAMILIES] + [("communication", f) for f in COMMUNICATION]
    checks += [("ops_worker.ops_equality",)]
    checks += [("fsdp_equality", f) for f in ("llama", "qwen3_5", "bamba")]
    return _no_errors(worker.spawn(4, checks, tmp_path_factory.mktemp("cp4")))


def _no_errors(results: dict) -> dict:
    failed = {key: value["error"] for key, value in results.items() if "error" in value}
    assert not failed, "\n".join(f"{key}:\n{error}" for key, error in failed.items())
    return results


@pytest.fixture(params=[2, 4], ids=["W2", "W4"])
def results(request, world2, world4) -> dict:
    return {2: world2, 4: world4}[request.param]


@pytest.mark.parametrize("family", FAMILIES)
def test_context_parallel_equals_one_process(results, family):
    """Logits, loss (the ranks' shares summed, relative) and every parameter's gradient (summed over ranks), for one
    row of 129 tokens (a padding document makes it divide by W; a 70-token document straddles the splits; a 1-token
    document) and for two rows of 61 tokens."""
    tolerance = TOLERANCE[family]
    for layout, figures in results[f"family_equality:{family}"].items():
        assert figures["logits"] <= tolerance, (layout, figures)
        assert figures["loss"] <= tolerance, (layout, figures)  # relative
        assert figures["grads"] <= tolerance, (layout, figures)
        assert figures["local_tokens"] * figures["world"] > figures["tokens"], figures  # a padding document was added


@pytest.mark.parametrize("family", FAMILIES)
def test_controls_miss_by_far(results, family):
    """Without the all-to-alls a rank's documents are cut at its slice edge; without the sum over ranks a rank
    has only its tokens' share of the gradient: both must miss the tolerance by far."""
    for layout, figures in results[f"family_equality:{family}"].items():
        assert figures["control_logits"] >= 100 * TOLERANCE[family], (layout, figures)
        assert figures["control_grads"] >= 0.05, (layout, figures)


@pytest.mark.parametrize("family", COMMUNICATION)
def test_communication_follows_the_documented_formula(results, family):
    """Elements a rank sends in one forward, counted at every all-to-all, equal docs/context-parallel-evidence.md's
    ``sum over layers of (W - 1) / W^2 x T x e`` (e from the config: attention, Gated DeltaNet, Mamba2)."""
    figures = results[f"communication:{family}"]
    assert figures["measured"] == figures["formula"] > 0, figures


@pytest.mark.parametrize("op", OPS)
def test_each_op_under_context_parallel_equals_the_op(results, op):
    """Op level: attention (4 query heads over 2 kv heads: split at W=2, replicated at W=4), causal conv1d
    (channels and weight slices), the gated delta rule (2 q/k heads under 4 value heads) and the Mamba2 scan
    (4 heads over 2 groups): output and gradients (inputs, and parameters summed over ranks)."""
    figures = results["ops_worker.ops_equality"][op]
    assert figures["output"] <= OP_TOLERANCE, figures
    assert figures["grads"] <= OP_TOLERANCE, figures
    assert figures["control"] >= 100 * OP_TOLERANCE, figures


def test_compiled_context_parallel_model_is_one_graph_compiled_once(world2):
    """Llama under CP, torch.compile(fullgraph=True, dynamic=True, backend=aot_eager) per rank, forward and
    backward over 3 batches of different lengths and document counts: one graph (fullgraph: no break), compiled ==
    eager for logits and gradients."""
    figures = world2["compile_check:llama"]
    assert len(figures["row_lengths"]) == figures["batches"] == 3
    assert figures["graphs"] == 1, figures
    assert figures["logits"] <= 1e-6 and figures["grads"] <= 1e-6, figures


def test_compiled_context_parallel_ops_are_one_graph(world2):
    """The hybrids' ops' CP paths (conv, gated delta rule, Mamba2 scan, all-to-alls included) in one compiled
    function, forward and backward, over 3 row lengths: one graph; compiled == eager."""
    figures = world2["ops_worker.ops_compile"]
    assert figures["graphs"] == 1, figures
    assert figures["compiled_vs_eager"] <= 1e-6, figures


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "bamba"])
def test_context_parallel_with_fsdp2_equals_one_process(world4, family):
    """2 data-parallel replicas x CP 2 on 4 processes, FSDP2 sharding the parameters over all 4: the gradient is
    one process's gradient of the mean of the replicas' losses; control: one replica's gradient alone."""
    figures = world4[f"fsdp_equality:{family}"]
    assert figures["sharded"], figures
    assert figures["grads"] <= TOLERANCE[family], figures
    assert figures["control_one_replica"] >= 0.05, figures


REFUSALS = {
    "indivisible_heads": "num_attention_heads=3 does not divide by the context-parallel size 2",
    "indivisible_groups": "mamba_n_groups=3 and the context-parallel size 2 do not divide one another",
    "indivisible_channels": "its 3 channels (the layer's conv_dim) do not divide by the context-parallel size 2",
    "unsupported_family": "context parallelism does not support mamba yet",
    "unsharded_batch": "the model runs context-parallel over 2 ranks but the batch was not sharded",
    "sharded_for_plain_model": "the batch was sharded for context parallelism",
    "sharded_for_other_group": "shard with the group the model was patched with",
    "different_batches": "holds a different global batch than rank(s) [1]",
    "two_dimensional_mesh": "got a 2-D DeviceMesh; pass its context-parallel dimension",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_problem(world2, case):
    message = world2["refusals"][case]
    assert message.startswith("ContextParallelError: "), message
    assert REFUSALS[case] in message, message
