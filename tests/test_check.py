"""``python -m compilepack check`` and compilepack.testing: they pass on patched models, and each FAILS, naming the
right check and carrying the figure, on the faults they exist to catch (a stock hybrid's position_ids-only packing,
boundaries dropped, a ``.item()`` in a forward, a forward that recompiles on the document count)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

import compilepack
from compilepack import testing
from compilepack.cli.check import run_checks
from compilepack.cli import main
from compilepack.patching import family_named
from tests.families import available_families, build_tiny, tiny_config


def _tiny(name: str, patch: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_tiny(family_named(name)).eval()
    return compilepack.patch(model) if patch else model


def _batches(model) -> list[testing.PackedBatch]:
    return testing.packed_batches(model.config.get_text_config().vocab_size, chunk=testing.chunk_size_of(model.config))


# ------------------------------------------------------------------------------------------- passing on every family


@pytest.mark.parametrize("family", available_families(), ids=lambda f: f.name)
def test_check_passes_on_every_family_first_tiny_config(family):
    """What tests/patches does not already run per family: packed == alone on two rows (a chunk edge inside a
    document of each; tests/patches runs one row with a 70-token document across the edge, with gradients and the
    control, and the command's test below runs all five cases) and the refusal of malformed batches."""
    model = _tiny(family.name)
    batches = _batches(model)
    assert [case.name for case in batches] == ["mixed", "chunk_edges", "single", "many_short", "two_rows"]
    testing.assert_packed_matches_unpacked(model, batches[4], gradients=False, control=False)
    testing.assert_refuses_bad_batches(model)


def test_check_cli_passes_on_a_tiny_checkpoint_config(tmp_path, capsys):
    """The whole command on a checkpoint directory's config.json: table, verdict, JSON, exit code 0."""
    tiny_config(family_named("llama")).save_pretrained(tmp_path)
    report = tmp_path / "report.json"
    code = main(["check", str(tmp_path / "config.json"), "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "VERDICT: PASS" in out
    checks = json.loads(report.read_text())["checks"]
    assert [c["name"] for c in checks] == ["packed == alone", "isolation", "compile", "bf16 autocast", "refusal"]
    assert all(c["passed"] for c in checks)
    assert checks[2]["values"]["compiles"] == 1


def _real_width_qwen3_5(layers: int = 24) -> transformers.PretrainedConfig:
    """Qwen3.5 at real widths (hidden 1024, vocab 248320, 16 linear-attention heads of 128, 8 attention heads of
    256, 3 linear : 1 full), built in code: nothing is downloaded."""
    return transformers.Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=4096)


@pytest.mark.slow
def test_check_passes_at_real_widths_with_one_layer_per_kind(tmp_path):
    """A real-width config (as a checkpoint's config.json) reduced to one layer of each kind: packed == alone and
    bit-exact isolation. The whole command at this size takes minutes on 2 cores, most of it in the 248320-wide
    logits (docs/checking.md)."""
    _real_width_qwen3_5().save_pretrained(tmp_path)
    model = testing.build_model(tmp_path / "config.json")
    assert model.config.layer_types == ["linear_attention", "full_attention"]
    # short, so the 248320-wide logits stay cheap: a 1-token document and one across the reference's chunk edge (32)
    case = testing.packed_batch([[5] * 40, [7], list(range(3, 12))])
    testing.assert_packed_matches_unpacked(model, case, gradients=False, control=False)
    testing.assert_documents_isolated(model, case)


def test_reduced_config_keeps_one_layer_of_each_kind():
    """A real-width Qwen3.5 config (hidden 1024, vocab 248320, 24 layers, 3 linear : 1 full) reduces to one
    linear-attention and one full-attention layer, built on the meta device (nothing allocated)."""
    config = _real_width_qwen3_5()
    reduced = testing.reduced_config(config)
    assert reduced.layer_types == ["linear_attention", "full_attention"]
    assert reduced.num_hidden_layers == 2 and config.num_hidden_layers == 24
    assert testing.reduced_config(config, 5).layer_types == config.layer_types[:5]


def test_reduced_config_of_index_declared_layers_keeps_the_shortest_prefix():
    """Bamba declares its attention layers by index (attn_layer_indices=[3]): one Mamba layer and layer 3 cannot
    be expressed by cutting lists, so the shortest prefix holding both kinds is kept, with the index kept."""
    config = transformers.BambaConfig(num_hidden_layers=8, attn_layer_indices=[3], hidden_size=64,
                                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                      mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, vocab_size=256)
    reduced = testing.reduced_config(config)
    assert reduced.num_hidden_layers == 2 and reduced.attn_layer_indices == [1] or (
        reduced.num_hidden_layers == 4 and reduced.attn_layer_indices == [3]), vars(reduced)


# --------------------------------------------------------------------------------------------------- failing cases


def test_stock_hybrid_with_position_ids_only_packing_fails_the_leak_check():
    stock = _tiny("qwen3_5", patch=False)
    with pytest.raises(AssertionError, match=r"packed == alone FAILED: logits [\d.e+-]+ ") as failure:
        testing.assert_packed_matches_unpacked(stock, _batches(stock)[:1], packed=testing.position_ids_only,
                                               gradients=False, control=False)
    leak = float(re.search(r"logits ([\d.e+-]+) ", str(failure.value)).group(1))
    assert leak > 100 * testing.HYBRID_TOLERANCE, str(failure.value)


def _drop_boundaries(model):
    """A patched model whose wrapper hands every row to the model as one document: the boundaries are dropped
    (positions still restart, so only the mixing is wrong)."""
    forward = model.forward

    def dropped(**batch):
        if batch.get("cu_seq_lens_q") is None:  # an unpacked batch (the reference): nothing to drop
            return forward(**batch)
        rows, length = batch["position_ids"].shape
        one_per_row = torch.arange(0, rows * length + 1, length, dtype=torch.int32)
        batch.update(cu_seq_lens_q=one_per_row, cu_seq_lens_k=one_per_row, max_length_q=length, max_length_k=length,
                     seq_idx=torch.arange(rows, dtype=torch.int32)[:, None].expand(rows, length).contiguous())
        return forward(**batch)

    model.forward = dropped
    return model


def test_patched_model_with_dropped_boundaries_fails_the_leak_and_isolation_checks():
    model = _drop_boundaries(_tiny("qwen3_5"))
    batches = _batches(model)[:1]
    leak = testing.check_packed_matches_unpacked(model, batches, gradients=False, control=False)
    assert not leak.passed and leak.values["logits"] > 100 * leak.values["tolerance"], str(leak)
    with pytest.raises(AssertionError, match=r"isolation FAILED: logits moved [\d.e-]+, gradient across [\d.e-]+"):
        testing.assert_documents_isolated(model, batches)


def _with_layer_hook(model, hook):
    """Run ``hook(hidden_states, kwargs)`` at the top of the first decoder layer's forward."""
    layer = model.model.layers[0]
    forward = layer.forward

    def hooked(hidden_states, *args, **kwargs):
        return forward(hook(hidden_states, kwargs), *args, **kwargs)

    layer.forward = hooked
    return model


def test_item_in_a_forward_fails_the_compile_check_naming_the_break():
    def scale_by_largest(hidden_states, kwargs):
        return hidden_states / max(1.0, hidden_states.abs().max().item())  # reads a value: a graph break

    model = _with_layer_hook(_tiny("llama"), scale_by_largest)
    with pytest.raises(AssertionError, match=r"compile FAILED: forward \d+ graph\(s\) [1-9]\d* break\(s\)") as failure:
        testing.assert_compiles_once(model, testing.varied_batches(256, count=2), backward=False)
    assert "break: Unsupported Tensor.item() call" in str(failure.value)


def test_forward_that_recompiles_on_the_document_count_fails_the_compile_check():
    def per_document_loop(hidden_states, kwargs):
        cu_seqlens = kwargs["cu_seq_lens_q"]
        for i in range(cu_seqlens.shape[0] - 1):  # a Python loop over documents: unrolled per document count
            hidden_states = hidden_states + 0.0 * cu_seqlens[i]
        return hidden_states

    model = _with_layer_hook(_tiny("llama"), per_document_loop)
    result = testing.check_compiles_once(model, testing.varied_batches(256, count=3), backward=False)
    assert not result.passed and result.values["forward"] == {"graphs": 1, "breaks": 0}
    assert result.values["compiles"] > 1, str(result)
    assert any(line.startswith("recompile:") for line in result.details), result.details


def test_refusal_check_fails_on_a_batch_that_runs_silently():
    """A batch neither the model nor compilepack.validate catches: the three documents' boundaries dropped (they
    run as one document). The model runs it and mixes the documents: the check names it, with the error."""
    model = _tiny("llama")
    documents = testing.malformed_documents(256)
    undetected = {"undetected": testing.packed_batch([sum(documents, [])]).batch}
    result = testing.check_refuses_bad_batches(model, undetected)
    assert not result.passed and result.values["silent"] == ["undetected"]
    assert result.values["refused_by_host"] == [] and result.figure.startswith("model 0/1 refused or exact")
    assert re.match(r"undetected: RAN SILENTLY: the model mixed its documents \(logits off by [\d.e+-]+, tolerance "
                    r"1e-05\); compilepack.validate accepts it", result.details[0]), result.details[0]


def test_refusal_check_measures_the_model_not_the_host_check():
    """The control of the refusal row: stock Llama runs every malformed batch and mixes its documents; that the
    host check (compilepack.validate) refuses all 8 must not make it pass. A stock hybrid fails too (it cannot even
    run the well-formed batch on this CPU); the patched model refuses 7 and runs the host-only fault (labels across
    a document start) exactly."""
    names = list(testing.malformed_batches(256))
    stock = testing.check_refuses_bad_batches(_tiny("llama", patch=False))
    assert not stock.passed and stock.values["silent"] == names and stock.values["refused_by_host"] == names
    assert stock.figure == "model 0/8 refused or exact (0 refused, 0 exact); host check 8/8 refused", stock.figure
    with pytest.raises(AssertionError, match=r"refusal FAILED: model 0/8 .*\n  position_ids restart, no boundary "
                                             r"kwargs: RAN SILENTLY"):
        testing.assert_refuses_bad_batches(_tiny("llama", patch=False))
    hybrid = testing.check_refuses_bad_batches(_tiny("qwen3_5", patch=False))
    assert not hybrid.passed, str(hybrid)
    patched = testing.assert_refuses_bad_batches(_tiny("llama"))
    assert patched.figure == "model 8/8 refused or exact (7 refused, 1 exact); host check 8/8 refused"
    assert patched.values["exact"] == ["labels across a document start"]


def test_refusal_of_the_check_command_fails_on_stock_llama(capsys):
    assert main(["check", "llama", "--stock", "--checks", "refusal"]) == 1
    out = capsys.readouterr().out
    assert "refusal  FAIL    model 0/8 refused or exact" in out and "VERDICT: FAIL (refusal)" in out


def test_refusal_check_refuses_batches_of_other_documents():
    """The "exact" measure compares a batch with the documents it holds: a batch of other tokens is a misuse."""
    result = testing.check_refuses_bad_batches(_tiny("llama"), {"other": testing.packed_batch([[5, 6, 7]]).batch})
    assert not result.passed and "the batch 'other' does not hold the tokens of the documents" in result.details[0]


def test_unsupported_model_says_so_and_shows_the_stock_leak(tmp_path, capsys):
    """A model type compilepack has no family for: 'not supported: ...' plus the stock leak figures, exit 1."""
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=512)
    config.save_pretrained(tmp_path)
    code = main(["check", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "not supported: compilepack has no patch for model_type 'gpt2'" in out
    assert "packed == alone  FAIL" in out and "VERDICT: not supported" in out


def test_weights_load_from_safetensors_only_unless_pickle_is_allowed(tmp_path, capsys):
    torch.manual_seed(0)
    model = build_tiny(family_named("llama"))
    model.save_pretrained(tmp_path / "safe")
    (tmp_path / "pickled").mkdir()
    model.config.save_pretrained(tmp_path / "pickled")
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    assert main(["check", str(tmp_path / "safe"), "--weights", "--checks", "refusal"]) == 0
    assert "checkpoint weights" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "pickled"), "--weights", "--checks", "refusal"]) == 2
    assert "--allow-pickle also loads pickled .bin weights" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "pickled"), "--weights", "--allow-pickle", "--checks", "refusal"]) == 0


def test_custom_code_is_refused_without_trust_remote_code(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "my_model", "auto_map": {"AutoConfig": "configuration_my_model.MyConfig"}}))
    assert main(["check", str(tmp_path)]) == 2
    assert "pass --trust-remote-code" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "says"), [
    ('{"model_type": "x",\n', "is not valid JSON (Expecting property name enclosed in double quotes: line 2"),
    ('{"hidden_size": 64}', 'has no "model_type": transformers cannot tell which architecture to build. Add'),
    ('{"model_type": "no_such_model"}', "has model_type 'no_such_model', which transformers"),
], ids=["malformed JSON", "no model_type", "unknown model_type"])
def test_an_unreadable_config_exits_2_with_one_paragraph_naming_the_file(tmp_path, capsys, text, says):
    (tmp_path / "config.json").write_text(text)
    assert main(["check", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"compilepack check: {tmp_path / 'config.json'} {says}"), captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""
    with pytest.raises(testing.ConfigError, match=re.escape(says)):  # build_model reads configs with the same loader
        testing.build_model(tmp_path / "config.json")


def test_json_report_into_a_missing_folder_creates_it(tmp_path, capsys):
    report = tmp_path / "reports" / "today" / "llama.json"
    assert main(["check", "llama", "--checks", "refusal", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["passed"] is True
    capsys.readouterr()
    assert main(["check", "llama", "--checks", "refusal", "--json", str(tmp_path)]) == 2  # a folder: before any check
    assert capsys.readouterr().err == (f"compilepack check: --json {tmp_path} is a folder: give the report's file "
                                       f"name, e.g. {tmp_path / 'report.json'}.\n")


def test_a_failing_check_reports_the_failure_in_the_table(capsys):
    model = _drop_boundaries(_tiny("llama"))
    results = run_checks(model, ["packed"])
    from compilepack.cli.check import format_table

    table = format_table(results)
    assert "packed == alone  FAIL" in table and "worst batch" in table


def test_check_object_helpers_do_not_keep_gradients(tmp_path):
    model = _tiny("llama")
    testing.check_packed_matches_unpacked(model, _batches(model)[:1])
    assert all(p.grad is None for p in model.parameters())
