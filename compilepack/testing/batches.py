"""The batches the checks run: packed batches holding the cases that break packing, a compile stream of varied
lengths, the same batches without boundary kwargs, malformed batches that must never run silently, and the
right-padded batch stock trains on (the baseline packing is measured against)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from ..batch.keys import (
    ATTENTION_MASK,
    BOUNDARY_KEYS,
    CU_SEQLENS_K,
    CU_SEQLENS_Q,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    SEQ_IDX,
)
from ..batch.layout import Boundaries

# the chunk of the pure-torch chunked references (compilepack/ops): documents are laid out to cross its edges
DEFAULT_CHUNK = 64
# the documents every malformed batch is made from: 10, 5 and 3 tokens in one row
MALFORMED_LENGTHS = (10, 5, 3)


class PackedBatch(NamedTuple):
    """A packed batch (``model(**batch)``) with the documents it holds, in order."""

    name: str
    documents: list[list[int]]
    batch: dict

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of every document in the flattened tokens."""
        cu = self.batch[CU_SEQLENS_Q].tolist()
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
    batch = {INPUT_IDS: tokens, LABELS: labels.view(rows, -1), **boundaries.as_kwargs()}
    return PackedBatch(name, documents, batch)


def padded_batch(documents: Sequence[Sequence[int]], multiple_of: int = 1, pad_token_id: int = 0) -> dict:
    """The right-padded ``[len(documents), L]`` batch ``DataCollatorForLanguageModeling`` makes: ``attention_mask``
    0 and ``labels`` -100 on the pads; ``L`` is the longest document, rounded up to ``multiple_of``.

    >>> padded_batch([[5, 6, 7], [8]])["labels"]
    tensor([[   5,    6,    7],
            [   8, -100, -100]])
    """
    length = math.ceil(max(len(doc) for doc in documents) / multiple_of) * multiple_of
    input_ids = torch.full((len(documents), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(documents), length), dtype=torch.long)
    for row, doc in enumerate(documents):
        input_ids[row, : len(doc)] = torch.tensor(doc, dtype=torch.long)
        attention_mask[row, : len(doc)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask, LABELS: labels}


def packed_batches(vocab_size: int, *, chunk: int = DEFAULT_CHUNK, seed: int = 0) -> list[PackedBatch]:
    """Packed batches with the cases that break packing: 1-token documents, documents crossing the chunk edges of
    chunked mixers (``chunk``: see :func:`chunk_size_of`), a single document, many short ones, and two rows."""
    rng = random.Random(seed)

    def docs(lengths):
        return random_documents(rng, vocab_size, lengths)

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
    batches = [packed_batch(random_documents(rng, vocab_size, [70, 1, 23, 5, 1, 40])).batch]
    while len(batches) < count:
        lengths = [rng.randint(1, max_len) for _ in range(rng.randint(1, 6))]
        batches.append(packed_batch(random_documents(rng, vocab_size, lengths)).batch)
    return batches


def random_documents(rng: random.Random, vocab_size: int, lengths: Iterable[int]) -> list[list[int]]:
    """Documents of these lengths, of random tokens 1..vocab_size-1."""
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


def position_ids_only(batch: Mapping) -> dict:
    """The same packed batch without boundary kwargs: only ``position_ids`` restarting per document mark the
    documents (``DataCollatorWithFlattening()``'s default output). Stock models infer (or ignore) boundaries
    from it; a patched model refuses it."""
    return {key: value for key, value in batch.items() if key not in BOUNDARY_KEYS}


def malformed_documents(vocab_size: int) -> list[list[int]]:
    """The documents (``MALFORMED_LENGTHS`` tokens) every batch of :func:`malformed_batches` is made from."""
    return random_documents(random.Random(0), vocab_size, MALFORMED_LENGTHS)


def malformed_batches(vocab_size: int) -> dict[str, dict]:
    """Batches that must never run silently: each mixes documents, drops tokens or trains across documents if
    accepted. Built from one well-formed batch of three documents (10, 5 and 3 tokens:
    :func:`malformed_documents`)."""

    def bad(**changes):
        batch = packed_batch(malformed_documents(vocab_size)).batch
        for key, value in changes.items():
            batch.pop(key) if value is None else batch.__setitem__(key, value)
        return batch

    def cu(*values):
        return torch.tensor(values, dtype=torch.int32)

    def cu_seq_lens(*values):
        return {CU_SEQLENS_Q: cu(*values), CU_SEQLENS_K: cu(*values)}

    tokens = sum(MALFORMED_LENGTHS)
    no_boundaries = dict.fromkeys(BOUNDARY_KEYS)
    return {
        "position_ids restart, no boundary kwargs": bad(**no_boundaries),
        "attention_mask with boundaries": bad(**{ATTENTION_MASK: torch.ones(1, tokens, dtype=torch.long)}),
        "cu_seq_lens not starting at 0": bad(**cu_seq_lens(1, 10, 15, 18)),
        "cu_seq_lens ending before the last token": bad(**cu_seq_lens(0, 10, 15)),
        "decreasing cu_seq_lens": bad(**cu_seq_lens(0, 10, 5, 18)),
        "seq_idx without cu_seq_lens": bad(**{**no_boundaries, SEQ_IDX: torch.zeros(1, tokens, dtype=torch.int32)}),
        "max_length below the longest document": bad(**{MAX_LENGTH_Q: 3, MAX_LENGTH_K: 3}),
        "labels across a document start": bad(**{LABELS: torch.arange(1, tokens + 1)[None]}),
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
