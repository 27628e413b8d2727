"""Every Python block in README.md and docs/ runs, so the documentation cannot rot.

The blocks of one file run in order in one namespace, as a reader would paste them. A block right after a line
``<!-- not run: <reason> -->`` is skipped, and the reason must be given. What a block cannot do here is stood in
for, and only that:

- checkpoints: ``from_pretrained`` of the Auto classes builds a tiny random model of the family the name implies
  (tests/families.py), and a tokenizer is a word-level one built in code (no download);
- data: the names ``samples`` (token-id lists), ``features`` (``[{"input_ids": ...}]``) and ``train_dataset`` (a
  ``datasets.Dataset`` of them) are defined before a file's first block;
- time: ``torch.compile`` defaults to the ``aot_eager`` backend (inductor takes tens of seconds per model on 2
  cores; the compile recipe itself is tested with inductor in tests/test_inductor.py), and training arguments to
  at most 2 steps on the CPU in a temporary directory.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from compilepack.patching import family_named
from tests.families import build_tiny

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.S)
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>.+?) -->")
# checkpoint names in the docs -> the family whose tiny model stands in for them
CHECKPOINT_FAMILIES = {"qwen3.5": "qwen3_5", "qwen3-next": "qwen3_next", "bamba": "bamba", "llama": "llama"}


def blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, reason it is not run) for every ```python block of a file."""
    text = path.read_text()
    found = []
    for match in BLOCK.finditer(text):
        line = text[: match.start("code")].count("\n") + 1
        reason = NOT_RUN.search(match.group("before"))
        found.append((line, match.group("code"), reason.group("reason").strip() if reason else None))
    return found


def _family_of_checkpoint(name: str) -> str:
    lowered = name.lower()
    return next((family for key, family in CHECKPOINT_FAMILIES.items() if key in lowered), "llama")


def _word_tokenizer(vocab_size: int = 256):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", unk_token="t1", eos_token="t2")


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    import transformers
    from datasets import Dataset

    def tiny_model(cls):
        def from_pretrained(name, *args, **kwargs):
            torch.manual_seed(0)
            return build_tiny(family_named(_family_of_checkpoint(str(name))))

        return from_pretrained

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        monkeypatch.setattr(cls, "from_pretrained", tiny_model(cls))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _word_tokenizer())
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model=None, **kwargs: compile_(
        model, **{"backend": "aot_eager", **kwargs}) if model is not None else
        (lambda m: compile_(m, **{"backend": "aot_eager", **kwargs})))
    for cls in (transformers.TrainingArguments, *_trl_configs()):
        monkeypatch.setattr(cls, "__post_init__", _short_run(cls.__post_init__, tmp_path))
    rng = random.Random(0)
    samples = [[rng.randrange(3, 256) for _ in range(rng.randint(5, 60))] for _ in range(8)]
    return {
        "samples": samples,
        "features": [{"input_ids": s} for s in samples],
        "train_dataset": Dataset.from_dict({"input_ids": samples}),
    }


def _trl_configs():
    try:
        from trl import SFTConfig
    except ImportError:
        return ()
    return (SFTConfig,)


def _short_run(post_init, tmp_path):
    def __post_init__(self):
        self.output_dir = str(tmp_path / "out")
        self.max_steps, self.use_cpu, self.report_to, self.save_strategy = 2, True, [], "no"
        self.torch_compile_backend = "aot_eager" if self.torch_compile else self.torch_compile_backend
        self.dataloader_num_workers, self.disable_tqdm = 0, True
        post_init(self)

    return __post_init__


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs(path, stand_ins):
    namespace = {"__name__": "__docs__", **stand_ins}
    for line, code, reason in blocks(path):
        if reason is not None:
            continue
        try:
            exec(compile(code, f"{path.name}:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(
                f"{path.name}, the block at line {line} fails: {type(error).__name__}: {error}"
            ) from error


def test_blocks_not_run_say_why():
    for path in DOCS:
        text = path.read_text()
        for match in re.finditer(r"<!-- not run(?P<rest>[^>]*)-->", text):
            assert match.group("rest").startswith(": ") and len(match.group("rest").strip(": ")) > 8, (
                f"{path.name}: a skipped block must say why: {match.group(0)}"
            )


LINK = re.compile(r"\]\((?P<target>[^)\s]+?)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file: lower case, punctuation but ``-`` and ``_`` dropped, spaces to
    ``-`` (code spans and fenced blocks skipped)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` whose file or heading anchor does not exist."""
    broken = []
    for match in LINK.finditer(re.sub(r"```.*?```", "", path.read_text(), flags=re.S)):
        target = match.group("target")
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    assert broken_links(path) == []


def test_a_broken_anchor_is_reported(tmp_path):
    """The control: a link to a missing heading and one to a missing file are both caught."""
    (tmp_path / "other.md").write_text("# A title, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-title-with-code) [bad](other.md#no-such) [gone](missing.md)\n")
    assert broken_links(page) == ["other.md#no-such: no heading #no-such in other.md", "missing.md: no file missing.md"]
