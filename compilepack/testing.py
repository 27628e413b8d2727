"""Prove packing on your own model, in your own tests: the checks compilepack's own family tests run.

Each check is a plain function that raises ``AssertionError`` carrying the measured figures, so it fits any test
runner::

    import compilepack
    from compilepack import testing

    model = testing.build_model(name)    # family name, config or checkpoint: patched, random weights
    batches = testing.packed_batches(model.config.get_text_config().vocab_size)
    testing.assert_packed_matches_unpacked(model, batches)        # forward logits and gradients, fp32
    testing.assert_documents_isolated(model, batches)             # bit for bit, zero gradient across documents
    testing.assert_compiles_once(model, testing.varied_batches(model.config.get_text_config().vocab_size))
    testing.assert_bf16_close(model, batches[0])                  # within 2x the model's own bf16 error
    testing.assert_refuses_bad_batches(model)                     # malformed batches raise, never run silently

Each ``assert_*`` has a ``check_*`` twin returning a :class:`CheckResult` instead of raising (``python -m
compilepack check`` prints those). Loaded as a pytest plugin (``pytest -p compilepack.testing``), the module adds
the fixtures ``compilepack_model_factory`` and ``compilepack_batch_factory``.

The reference for "each document alone" is the model itself run on each document as a plain, unpacked batch
(a patched model runs stock code there), unless another ``reference`` model is given.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .boundaries import BOUNDARY_KEYS, Boundaries
from .errors import UnsupportedModelError
from .explain import count_compiles, explain
from .validation import IGNORE_INDEX, validate

# fp32 tolerances of packed vs each document alone, as compilepack's own tests use them: attention alone is exact
# up to summation order; chunked linear mixers (gated delta rule, SSD scans) add their chunked rounding.
ATTENTION_ONLY_TOLERANCE = 1e-5
HYBRID_TOLERANCE = 1e-4
# the leak control: the same documents run as one document must miss the tolerance by at least this factor, or the
# tolerance could not tell a leak from rounding
CONTROL_FACTOR = 100
# bf16: packed error per document at most this multiple of the model's own bf16 error on each document alone
# (flash-attention's rule: a kernel's error may be twice the same-dtype PyTorch error against fp32)
BF16_BAR = 2.0
# the chunk of the pure-torch chunked references (compilepack/ops): documents are laid out to cross its edges
DEFAULT_CHUNK = 64

__all__ = [
    "ATTENTION_ONLY_TOLERANCE",
    "BF16_BAR",
    "HYBRID_TOLERANCE",
    "CheckResult",
    "PackedBatch",
    "assert_bf16_close",
    "assert_compiles_once",
    "assert_documents_isolated",
    "assert_packed_matches_unpacked",
    "assert_refuses_bad_batches",
    "build_model",
    "check_bf16_close",
    "check_compiles_once",
    "check_documents_isolated",
    "check_packed_matches_unpacked",
    "check_refuses_bad_batches",
    "chunk_size_of",
    "malformed_batches",
    "packed_batch",
    "packed_batches",
    "position_ids_only",
    "reduced_config",
    "tolerance_for",
    "varied_batches",
]


# ------------------------------------------------------------------------------------------------------ results


@dataclasses.dataclass
class CheckResult:
    """One check's outcome: ``passed``, the measured ``figure`` and the ``threshold`` it was held to, as text;
    ``details`` are the lines that explain a failure (break reasons, which batch leaked, error messages)."""

    name: str
    passed: bool
    figure: str
    threshold: str
    details: list[str] = dataclasses.field(default_factory=list)
    values: dict = dataclasses.field(default_factory=dict)  # the figures as numbers, for JSON

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        text = f"{self.name} {verdict}: {self.figure} (threshold {self.threshold})"
        return text + "".join(f"\n  {line}" for line in self.details)


def _raise_unless(result: CheckResult) -> CheckResult:
    if not result.passed:
        raise AssertionError(str(result))
    return result


# ------------------------------------------------------------------------------------------------------ batches


class PackedBatch(NamedTuple):
    """A packed batch (``model(**batch)``) with the documents it holds, in order."""

    name: str
    documents: list[list[int]]
    batch: dict

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of every document in the flattened tokens."""
        cu = self.batch["cu_seq_lens_q"].tolist()
        return list(zip(cu[:-1], cu[1:]))


def packed_batch(documents: Sequence[Sequence[int]], rows: int = 1, name: str = "") -> PackedBatch:
    """The HF collator's packed layout of ``documents`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
    return_seq_idx=True)``'s keys), in ``rows`` equal rows whose edges are document edges.

    >>> packed_batch([[5, 6, 7], [8, 9]]).batch["cu_seq_lens_q"]
    tensor([0, 3, 5], dtype=torch.int32)
    """
    documents = [list(doc) for doc in documents]
    boundaries = Boundaries.from_lengths([len(doc) for doc in documents], rows=rows)
    tokens = torch.tensor([token for doc in documents for token in doc]).view(rows, -1)
    labels = tokens.clone().flatten()
    labels[boundaries.cu_seqlens[:-1].long()] = IGNORE_INDEX  # a document's first token is nobody's target
    return PackedBatch(name, documents, {"input_ids": tokens, "labels": labels.view(rows, -1), **boundaries.as_kwargs()})


def packed_batches(vocab_size: int, *, chunk: int = DEFAULT_CHUNK, seed: int = 0) -> list[PackedBatch]:
    """Packed batches with the cases that break packing: 1-token documents, documents crossing the chunk edges of
    chunked mixers (``chunk``: see :func:`chunk_size_of`), a single document, many short ones, and two rows."""
    rng = random.Random(seed)

    def docs(lengths):
        return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]

    row = chunk + 16  # two rows of this length; a chunk edge inside a document of each
    return [
        packed_batch(docs([70, 1, 23, 5, 1, 40]), name="mixed"),
        packed_batch(docs([chunk - 1, 2, chunk, 1, chunk + 1]), name="chunk_edges"),
        packed_batch(docs([chunk + 9]), name="single"),
        packed_batch(docs([rng.randint(1, 6) for _ in range(12)]), name="many_short"),
        packed_batch(docs([9, chunk - 2, 1, row - chunk - 8, row - 4, 4]), rows=2, name="two_rows"),
    ]


def varied_batches(vocab_size: int, count: int = 8, *, seed: int = 0, max_len: int = 150) -> list[dict]:
    """``count`` packed batches of different token counts and document counts (1 to 6 documents): a compile
    stream. Its first batch has 1-token documents and a document longer than a chunk."""
    rng = random.Random(seed)
    batches = [packed_batch(_random_docs(rng, vocab_size, [70, 1, 23, 5, 1, 40])).batch]
    while len(batches) < count:
        lengths = [rng.randint(1, max_len) for _ in range(rng.randint(1, 6))]
        batches.append(packed_batch(_random_docs(rng, vocab_size, lengths)).batch)
    return batches


def _random_docs(rng: random.Random, vocab_size: int, lengths: Iterable[int]) -> list[list[int]]:
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


def position_ids_only(batch: Mapping) -> dict:
    """The same packed batch without boundary kwargs: only ``position_ids`` restarting per document mark the
    documents (``DataCollatorWithFlattening()``'s default output). Stock models infer (or ignore) boundaries
    from it; a patched model refuses it."""
    return {key: value for key, value in batch.items() if key not in BOUNDARY_KEYS}


def malformed_batches(vocab_size: int) -> dict[str, dict]:
    """Batches that must never run silently: each mixes documents, drops tokens or trains across documents if
    accepted. Built from one well-formed batch of three documents (10, 5 and 3 tokens)."""

    def bad(**changes):
        batch = packed_batch(_random_docs(random.Random(0), vocab_size, [10, 5, 3])).batch
        for key, value in changes.items():
            batch.pop(key) if value is None else batch.__setitem__(key, value)
        return batch

    def cu(*values):
        return torch.tensor(values, dtype=torch.int32)

    no_boundaries = dict.fromkeys(BOUNDARY_KEYS)
    return {
        "position_ids restart, no boundary kwargs": bad(**no_boundaries),
        "attention_mask with boundaries": bad(attention_mask=torch.ones(1, 18, dtype=torch.long)),
        "cu_seq_lens not starting at 0": bad(cu_seq_lens_q=cu(1, 10, 15, 18), cu_seq_lens_k=cu(1, 10, 15, 18)),
        "cu_seq_lens ending before the last token": bad(cu_seq_lens_q=cu(0, 10, 15), cu_seq_lens_k=cu(0, 10, 15)),
        "decreasing cu_seq_lens": bad(cu_seq_lens_q=cu(0, 10, 5, 18), cu_seq_lens_k=cu(0, 10, 5, 18)),
        "seq_idx without cu_seq_lens": bad(**{**no_boundaries, "seq_idx": torch.zeros(1, 18, dtype=torch.int32)}),
        "max_length below the longest document": bad(max_length_q=3, max_length_k=3),
        "labels across a document start": bad(labels=torch.arange(1, 19)[None]),
    }


def chunk_size_of(config) -> int:
    """The chunk size of a model's chunked mixers (``chunk_size`` / ``mamba_chunk_size``), else the references'
    ``DEFAULT_CHUNK``: documents of :func:`packed_batches` cross its edges."""
    text = config.get_text_config()
    for name in ("mamba_chunk_size", "chunk_size"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CHUNK


# ------------------------------------------------------------------------------------------------------- models


def layer_kinds(model: torch.nn.Module) -> list[tuple]:
    """One signature per decoder layer: its submodules' classes and parameter shapes (two layers of one kind
    have the same signature)."""
    layers = _decoder_layers(model)
    return [
        tuple((name, type(module).__name__) for name, module in layer.named_modules())
        + tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
        for layer in layers
    ]


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    count = model.config.get_text_config().num_hidden_layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no ModuleList of {count} layers (num_hidden_layers) was found.")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def reduced_config(config, layers: int | None = None, *, builder: Callable | None = None, prefix: bool = False):
    """A copy of ``config`` with fewer decoder layers: ``layers`` first layers, or by default one layer of each
    kind the full model has (kinds as :func:`layer_kinds` sees them on a meta-device build, which allocates
    nothing). Per-layer lists (``layer_types``, ``layers_block_type``, ``mlp_layer_types``...) are cut to the
    kept layers; when the config cannot say which layer is which kind that way (layer indices, periods), or with
    ``prefix=True`` (loading real weights by layer index), the shortest prefix holding every kind is kept.
    """
    builder = builder or _auto_builder()
    text = config.get_text_config()
    total = text.num_hidden_layers
    if layers is not None:
        return _with_layers(config, list(range(min(layers, total))))
    kinds = layer_kinds(_on_meta(builder, config))
    first = list({kind: index for index, kind in reversed(list(enumerate(kinds)))}.values())
    first.sort()
    candidates = [] if prefix else [first]
    candidates.append(list(range(max(first) + 1)))
    for keep in candidates:
        reduced = _with_layers(config, keep)
        if set(layer_kinds(_on_meta(builder, reduced))) == set(kinds):
            return reduced
    return copy.deepcopy(config)


def _with_layers(config, keep: list[int]):
    config = copy.deepcopy(config)
    text = config.get_text_config()
    total = text.num_hidden_layers
    for name, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and len(value) == total and ("layer" in name or "block" in name):
            setattr(text, name, type(value)(value[i] for i in keep))
        elif isinstance(value, (list, tuple)) and name.endswith(("_indices", "_only_layers", "_layer_ids")):
            setattr(text, name, type(value)(keep.index(i) for i in value if i in keep))
    text.num_hidden_layers = len(keep)
    return config


def _auto_builder() -> Callable:
    import transformers

    def build(config):
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
            with contextlib.suppress(ValueError):
                return auto.from_config(config)
        raise UnsupportedModelError(f"transformers has no causal-LM class for config {type(config).__name__}.")

    return build


def _on_meta(builder: Callable, config) -> torch.nn.Module:
    with torch.device("meta"):
        return builder(config)


def build_model(model, *, layers: int | str | None = "per_kind", seed: int = 0, patch: bool = True) -> torch.nn.Module:
    """A randomly initialised fp32 model in eval mode, patched unless ``patch=False``: the model factory.

    ``model`` is a compilepack family name (its benchmark config: hidden 256, one layer per mixer kind), a
    ``transformers`` config, or a path to a checkpoint directory or its ``config.json`` (only the config is read).
    ``layers``: ``"per_kind"`` (default) keeps one layer of each kind the config has, an int the first N layers,
    None every layer.
    """
    import compilepack

    config = _config_of(model)
    if layers == "per_kind":
        config = reduced_config(config)
    elif layers is not None:
        config = reduced_config(config, int(layers))
    torch.manual_seed(seed)
    built = _auto_builder()(config).float().eval()
    return compilepack.patch(built) if patch else built


def _config_of(model):
    if not isinstance(model, str) and hasattr(model, "model_type"):
        return model
    from .patching import family_named, supported_model_types

    if isinstance(model, str) and model in supported_model_types():
        return family_named(model).bench_config()
    import transformers

    path = Path(model)
    return transformers.AutoConfig.from_pretrained(str(path.parent if path.suffix == ".json" else path))


def tolerance_for(model: torch.nn.Module) -> float:
    """The fp32 tolerance of packed vs alone for this model: 1e-5 when only attention mixes tokens, 1e-4 when a
    registered family has other mixers, and for a model compilepack does not know."""
    from .patching import family_of

    try:
        family = family_of(model)
    except UnsupportedModelError:
        return HYBRID_TOLERANCE
    only_attention = all(r.global_name == "ALL_ATTENTION_FUNCTIONS" for needed in family.layers.values() for r in needed)
    return ATTENTION_ONLY_TOLERANCE if only_attention else HYBRID_TOLERANCE


# ----------------------------------------------------------------------------------- 1. packed == each document alone


def check_packed_matches_unpacked(
    model: torch.nn.Module,
    batches: Sequence[PackedBatch] | PackedBatch,
    *,
    reference: torch.nn.Module | None = None,
    tolerance: float | None = None,
    gradients: bool = True,
    control: bool = True,
    packed: Callable[[dict], dict] = lambda batch: batch,
    **forward_kwargs,
) -> CheckResult:
    """Packed logits (and, with ``gradients``, parameter gradients of the summed token loss) equal the same
    documents run one by one through ``reference`` (default: ``model`` on plain unpacked batches).

    Logits: max |packed - alone| over every document of every batch. Gradients (first batch): max |packed - sum
    over documents| relative to the largest gradient entry. With ``control``, the first batch's documents run as
    one long document (boundaries dropped) must miss the tolerance by ``CONTROL_FACTOR``x. ``packed`` rewrites a
    batch before the model sees it (:func:`position_ids_only` to test a stock model's own packing);
    ``forward_kwargs`` go to the packed call (``use_cache=True``).
    """
    batches = _as_list(batches)
    reference = reference if reference is not None else model
    tolerance = tolerance if tolerance is not None else tolerance_for(model)
    errors, details = {}, []
    alone = {case.name: _logits_alone(reference, case.documents) for case in batches}  # the reference, once
    for case in batches:
        errors[case.name] = _logits_error(model, alone[case.name], case, packed, forward_kwargs)
    logits_error = max(errors.values())
    worst = max(errors, key=errors.get)
    figures = {"logits": logits_error}
    if gradients:
        figures["gradients"] = _gradients_error(model, reference, batches[0], packed)
    if control:
        figures["control"] = _merged_error(model, alone[batches[0].name], batches[0], packed)
    passed = logits_error <= tolerance and figures.get("gradients", 0.0) <= tolerance
    if logits_error > tolerance:
        details.append(f"worst batch: {worst} ({_describe(batches, worst)}); per batch: "
                       + ", ".join(f"{name} {error:.2e}" for name, error in errors.items()))
    if control and figures["control"] < CONTROL_FACTOR * tolerance:
        passed = False
        details.append(f"the control cannot tell a leak from rounding: the documents run as one document miss by "
                       f"{figures['control']:.2e} only (needs >= {CONTROL_FACTOR * tolerance:.0e})")
    figure = ", ".join(f"{name} {value:.2e}" for name, value in figures.items())
    threshold = f"<= {tolerance:.0e}" + (f" (control >= {CONTROL_FACTOR * tolerance:.0e})" if control else "")
    return CheckResult("packed == alone", passed, figure, threshold, details, {**figures, "tolerance": tolerance})


def assert_packed_matches_unpacked(model, batches, **options) -> CheckResult:
    """:func:`check_packed_matches_unpacked`, raising ``AssertionError`` with the figures when it fails."""
    return _raise_unless(check_packed_matches_unpacked(model, batches, **options))


def _describe(batches: Sequence[PackedBatch], name: str) -> str:
    case = next(c for c in batches if c.name == name)
    return f"{len(case.documents)} documents of {[len(d) for d in case.documents]} tokens in {case.batch['input_ids'].shape[0]} row(s)"


def _logits_alone(model, documents) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([doc]), use_cache=False).logits[0].float() for doc in documents]


def _per_document(logits: torch.Tensor, spans) -> list[torch.Tensor]:
    flat = logits.reshape(-1, logits.shape[-1])
    return [flat[start:end].float() for start, end in spans]


def _logits_error(model, alone: list[torch.Tensor], case: PackedBatch, packed, forward_kwargs) -> float:
    with torch.no_grad():
        logits = model(**packed(case.batch), **forward_kwargs).logits
    return max((p - a).abs().max().item() for p, a in zip(_per_document(logits, case.spans), alone))


def _merged_error(model, alone: list[torch.Tensor], case: PackedBatch, packed) -> float:
    merged = packed_batch([[token for doc in case.documents for token in doc]])
    with torch.no_grad():
        logits = model(**packed(merged.batch)).logits
    return max((p - a).abs().max().item() for p, a in zip(_per_document(logits, case.spans), alone))


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM cross-entropy summed over target tokens (labels shifted by one, -100 ignored): summed, so the
    packed loss is exactly the sum of the documents' losses."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shifted.reshape(-1), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def _gradients_error(model, reference, case: PackedBatch, packed) -> float:
    batch = packed(case.batch)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    packed_grads = torch.autograd.grad(summed_token_loss(model(**batch).logits, batch["labels"]), params,
                                       allow_unused=True)
    ref_params = dict(reference.named_parameters())
    alone = {name: torch.zeros_like(ref_params[name]) for name in names}
    for doc in case.documents:
        single = packed_batch([doc]).batch
        loss = summed_token_loss(reference(input_ids=single["input_ids"], use_cache=False).logits, single["labels"])
        for name, grad in zip(names, torch.autograd.grad(loss, [ref_params[n] for n in names], allow_unused=True)):
            if grad is not None:
                alone[name] += grad
    scale = max(g.abs().max().item() for g in alone.values())
    return max(
        ((g if g is not None else torch.zeros_like(alone[n])) - alone[n]).abs().max().item()
        for n, g in zip(names, packed_grads)
    ) / scale


# --------------------------------------------------------------------------------------------------- 2. isolation


def check_documents_isolated(
    model: torch.nn.Module,
    batches: Sequence[PackedBatch] | PackedBatch,
    *,
    document: int | None = None,
    packed: Callable[[dict], dict] = lambda batch: batch,
) -> CheckResult:
    """One document of each multi-document batch (``document``, default the middle one) depends on nothing else:
    with every other document's input embeddings replaced by random ones, its logits are bit-identical, and a
    loss on its logits alone sends exactly 0.0 gradient into the other documents' embeddings."""
    changed, leaked, details, checked = 0.0, 0.0, [], 0
    for case in _as_list(batches):
        if len(case.documents) < 2:
            continue
        index = document if document is not None else len(case.documents) // 2
        same, moved, grad_out, grad_in = _isolation(model, packed(case.batch), case.spans[index])
        if not same or grad_out or not grad_in:
            details.append(f"{case.name}, document {index}: logits moved by {moved:.3g}, gradient into other "
                           f"documents {grad_out:.3g}" + ("" if grad_in else ", and no gradient into itself"))
        changed, leaked, checked = max(changed, moved), max(leaked, grad_out), checked + 1
    if not checked:
        details.append("no batch holds two documents: nothing to isolate")
    figure = f"logits moved {changed:.3g}, gradient across {leaked:.3g}"
    return CheckResult("isolation", not details, figure, "0 (bit for bit)", details,
                       {"logits_moved": changed, "gradient_across": leaked})


def assert_documents_isolated(model, batches, **options) -> CheckResult:
    """:func:`check_documents_isolated`, raising ``AssertionError`` with the figures when it fails."""
    return _raise_unless(check_documents_isolated(model, batches, **options))


def _isolation(model, batch: dict, span: tuple[int, int]) -> tuple[bool, float, float, bool]:
    """(logits bit-identical, largest change, largest gradient into other documents, any gradient into itself)."""
    start, end = span
    embed = model.get_input_embeddings()
    rows = batch["input_ids"].shape[0]
    with torch.no_grad():
        embeds = embed(batch["input_ids"]).reshape(-1, embed.embedding_dim)
        others = embeds.clone()
        generator = torch.Generator().manual_seed(start)
        others[:start] = torch.randn(others[:start].shape, generator=generator, dtype=others.dtype)
        others[end:] = torch.randn(others[end:].shape, generator=generator, dtype=others.dtype)
    kwargs = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
    embeds.requires_grad_(True)
    logits = model(inputs_embeds=embeds.view(rows, -1, embeds.shape[-1]), **kwargs).logits
    with torch.no_grad():
        logits_others = model(inputs_embeds=others.view(rows, -1, others.shape[-1]), **kwargs).logits
    mine = logits.reshape(-1, logits.shape[-1])[start:end]
    mine_others = logits_others.reshape(-1, logits.shape[-1])[start:end]
    same = torch.equal(mine, mine_others)
    moved = 0.0 if same else (mine.float() - mine_others.float()).abs().max().item()
    (grad,) = torch.autograd.grad(mine.float().square().sum(), embeds)
    outside = torch.cat([grad[:start], grad[end:]])
    grad_out = outside.abs().max().item() if outside.numel() else 0.0
    return same, moved, grad_out, bool(grad[start:end].abs().max() > 0)


# ----------------------------------------------------------------------------------------------------- 3. compile


def check_compiles_once(
    model: torch.nn.Module,
    batches: Sequence[Mapping],
    *,
    backward: bool = True,
    backend: str = "eager",
    packed: Callable[[dict], dict] = lambda batch: batch,
) -> CheckResult:
    """``torch.compile(fullgraph=True, dynamic=True)`` over ``batches``: one graph and no break for the forward
    (and, with ``backward``, forward+backward) of the first batch (``torch._dynamo.explain``'s counts), and one
    compile over the whole stream. ``backend``: ``"eager"`` (dynamo only: fast), ``"aot_eager"`` (also traces
    the custom ops' fakes and the backward graphs), or ``"inductor"`` (what training uses; slow on CPU)."""
    batches = [packed(batch) for batch in batches]
    details, values = [], {}
    reports = {"forward": _explained(model, batches[0], False)}
    if backward:
        reports["forward+backward"] = _explained(model, batches[0], True)
    for name, report in reports.items():
        values[name] = {"graphs": report.graphs, "breaks": report.graph_breaks}
        details += [f"{name} break: {reason}" for reason in report.break_reasons]
    clean = all(report.ok for report in reports.values())
    try:
        compiles = count_compiles(model, batches, dynamic=True, fullgraph=clean, backend=backend)
        values["compiles"] = compiles.compiles
        reasons = compiles.recompile_reasons
        details += [f"recompile: {reason}" for reason in reasons[:3]]
        details += [f"... and {len(reasons) - 3} more guard failures"] if len(reasons) > 3 else []
        compiled_once = compiles.compiles == 1
        stream = f"{compiles.compiles} compile(s) over {compiles.batches} batches"
    except Exception as error:  # fullgraph=True refused the model: say why
        compiled_once, stream = False, f"compile failed: {type(error).__name__}"
        details.append(f"torch.compile(fullgraph=True, dynamic=True): {_first_line(error)}")
    figure = "; ".join(f"{name} {r.graphs} graph(s) {r.graph_breaks} break(s)" for name, r in reports.items())
    return CheckResult("compile", clean and compiled_once, f"{figure}; {stream}",
                       "1 graph, 0 breaks, 1 compile", details, values)


def assert_compiles_once(model, batches, **options) -> CheckResult:
    """:func:`check_compiles_once`, raising ``AssertionError`` with the break and recompile reasons."""
    return _raise_unless(check_compiles_once(model, batches, **options))


def _explained(model, batch, backward: bool):
    training = model.training
    model.train(backward)
    try:
        return explain(model, batch, backward=backward)
    finally:
        model.train(training)


# -------------------------------------------------------------------------------------------------------- 4. bf16


def check_bf16_close(
    model: torch.nn.Module,
    case: PackedBatch,
    *,
    reference: torch.nn.Module | None = None,
    how: str = "autocast",
    bar: float = BF16_BAR,
    packed: Callable[[dict], dict] = lambda batch: batch,
) -> CheckResult:
    """A packed bf16 training step: its logits' error against fp32 (each document alone, through ``reference``)
    is at most ``bar`` x the reference's own bf16 error on each document alone, and its gradients are finite.

    The error of a run is its worst document's mean |logit difference| (a max over single logits would measure
    a mixture-of-experts router instead, where one near-tie token flipping its expert in bf16 decides the
    figure whichever side computes it). ``how``: ``"autocast"`` (CPU bf16 autocast, fp32 weights) or ``"cast"``
    (copies of both models cast to bf16).
    """
    reference = reference if reference is not None else model
    fp32 = _logits_alone(reference, case.documents)
    autocast = how == "autocast"
    if how == "cast":
        low, low_reference = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(reference).to(torch.bfloat16)
    else:
        low, low_reference = model, reference
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        own_error = _error(_logits_alone(low_reference, case.documents), fp32)
        batch = packed(case.batch)
        logits = low(**batch).logits
        loss = summed_token_loss(logits, batch["labels"])
    params = [p for p in low.parameters() if p.requires_grad]
    grads = [g for g in torch.autograd.grad(loss, params, allow_unused=True) if g is not None]
    finite = bool(grads) and all(torch.isfinite(g).all() for g in grads)
    error = _error(_per_document(logits.detach(), case.spans), fp32)
    passed = error <= bar * own_error and finite
    details = [] if finite else ["the bf16 backward gave no gradient or a non-finite one"]
    ratio = error / own_error if own_error else float("inf")
    figure = f"{error:.3g} vs own {own_error:.3g} ({ratio:.2f}x)"
    return CheckResult(f"bf16 {how}", passed, figure, f"<= {bar:g}x own", details,
                       {"error": error, "own_error": own_error, "finite_gradients": finite})


def assert_bf16_close(model, case, **options) -> CheckResult:
    """:func:`check_bf16_close`, raising ``AssertionError`` with the two errors when it fails."""
    return _raise_unless(check_bf16_close(model, case, **options))


def _error(pieces: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max((piece.float() - ref).abs().mean().item() for piece, ref in zip(pieces, reference))


# ----------------------------------------------------------------------------------------------------- 5. refusal


def check_refuses_bad_batches(model: torch.nn.Module, batches: Mapping[str, dict] | None = None) -> CheckResult:
    """Every malformed batch (:func:`malformed_batches`) raises, in the model itself or, for what the model runs,
    in ``compilepack.validate`` (the host check ``PackedCollator`` and ``compilepack.checked`` run on every batch):
    none runs silently. A well-formed batch of the same documents must run (a model that refuses everything
    proves nothing)."""
    vocab = model.config.get_text_config().vocab_size
    batches = batches if batches is not None else malformed_batches(vocab)
    good = packed_batch(_random_docs(random.Random(0), vocab, [10, 5, 3])).batch
    message = _refusal(lambda: model(**good))
    if message:  # a model that refuses everything proves nothing
        return CheckResult("refusal", False, "the well-formed batch fails", "all refused, the good batch runs",
                           [f"a well-formed batch of the same documents fails: {message}"])
    by_model, by_host, silent, details = [], [], [], []
    for name, batch in batches.items():
        message = _refusal(lambda: model(**batch))
        if message:
            by_model.append(name)
            details.append(f"{name}: refused by the model: {message}")
            continue
        message = _refusal(lambda: validate(batch))
        (by_host if message else silent).append(name)
        details.append(f"{name}: " + (f"the model ran it; refused by compilepack.validate: {message}" if message
                                      else "RAN SILENTLY (the model and compilepack.validate accepted it)"))
    figure = f"{len(by_model) + len(by_host)}/{len(batches)} refused (model {len(by_model)}, host check {len(by_host)})"
    details.sort(key=lambda line: "SILENTLY" not in line)
    return CheckResult("refusal", not silent, figure, "all refused", details,
                       {"by_model": by_model, "by_host": by_host, "silent": silent})


def assert_refuses_bad_batches(model, batches=None) -> CheckResult:
    """:func:`check_refuses_bad_batches`, raising ``AssertionError`` naming the batches that ran silently."""
    return _raise_unless(check_refuses_bad_batches(model, batches))


def _refusal(run: Callable) -> str:
    try:
        with torch.no_grad():
            run()
    except Exception as error:  # any error is a refusal: the batch did not run silently
        return f"{type(error).__name__}: {_first_line(error)[:160]}"
    return ""


def _first_line(error) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _as_list(batches) -> list[PackedBatch]:
    return [batches] if isinstance(batches, PackedBatch) else list(batches)


# ------------------------------------------------------------------------------------------------ pytest plugin

try:
    import pytest
except ImportError:  # the checks work without pytest; only the plugin needs it
    pytest = None

if pytest is not None:

    @pytest.fixture
    def compilepack_model_factory():
        """``factory(model, layers="per_kind", seed=0, patch=True)``: :func:`build_model` (a family name, a config,
        or a checkpoint's directory or config.json; random weights, fp32, eval mode)."""
        return build_model

    @pytest.fixture
    def compilepack_batch_factory():
        """``factory(model)``: :func:`packed_batches` for this model's vocabulary and chunk size."""

        def factory(model, seed: int = 0) -> list[PackedBatch]:
            config = model.config
            return packed_batches(config.get_text_config().vocab_size, chunk=chunk_size_of(config), seed=seed)

        return factory
