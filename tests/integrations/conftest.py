import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_state():
    """Fresh dynamo counters; TrainingArguments exports ACCELERATE_* variables and accelerate keeps a
    process-wide state: undo both after each test."""
    from torch._dynamo.utils import counters

    counters.clear()  # torch._dynamo.reset() keeps them; each test counts its own graphs and breaks
    saved = dict(os.environ)
    os.environ["HF_HUB_OFFLINE"] = "1"  # tiny models only; never wait on the network
    yield
    os.environ.clear()
    os.environ.update(saved)
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    AcceleratorState._reset_state(reset_partial_state=True)
