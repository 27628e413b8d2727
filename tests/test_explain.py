"""compilepack.explain counts what dynamo does: graphs, breaks with their reasons, ops; without resetting dynamo."""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutput

import compilepack


class _Breaking(torch.nn.Module):
    """``model(**batch).logits`` with one graph break (a data-dependent Python branch) in the middle."""

    def __init__(self, breaks: bool):
        super().__init__()
        self.linear, self.breaks = torch.nn.Linear(4, 4), breaks

    def forward(self, input_ids):
        hidden = self.linear(input_ids)
        if self.breaks and hidden.sum() > 0:  # reads a tensor value: dynamo must break here
            hidden = hidden * 2
        return CausalLMOutput(logits=self.linear(hidden))


def test_a_break_is_counted_with_its_reason():
    report = compilepack.explain(_Breaking(breaks=True), {"input_ids": torch.ones(2, 4)})
    assert report.graphs == 2 and report.graph_breaks == 1, str(report)
    assert report.break_reasons and report.break_reasons[0]
    assert not report.ok


def test_one_graph_without_breaks_forward_and_backward():
    for backward in (False, True):
        report = compilepack.explain(_Breaking(breaks=False), {"input_ids": torch.ones(2, 4)}, backward=backward)
        assert (report.graphs, report.graph_breaks) == (1, 0) and report.ok and report.ops > 0, str(report)


def test_repeated_explains_count_afresh():
    model = _Breaking(breaks=False)
    counts = [compilepack.explain(model, {"input_ids": torch.ones(2, 4)}).graphs for _ in range(10)]
    assert counts == [1] * 10  # neither reused nor stopped by dynamo's recompile limit (8)
