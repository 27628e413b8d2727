import atexit
import os
import shutil
import tempfile

# A fresh inductor cache per test session: inductor's FX graph cache keys a graph on its code, not on the fake
# implementations of the custom ops in it, so a graph cached before an op's saved-tensor shapes changed would be
# reused with the old shapes (seen: a gated-delta-rule chunk-size change failing an assert_size_stride).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compilepack-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

# The kernel stage's tests (real Triton kernels under the interpreter) need their own environment: collected only
# there, where CI runs them with TRITON_INTERPRET=1 (tests/kernels/install.sh).
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["kernels"]

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Two CPU cores: keep torch from oversubscribing them (one thread per pytest-xdist worker: two workers with two
# threads each made OpenMP regions wait on each other, e.g. a 20 us searchsorted took 20 ms), and keep hypothesis
# runs short but real.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test counts its own graphs and compiles."""
    import torch._dynamo
    import torch._dynamo.utils

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters that graph counts are read from
    yield
    torch._dynamo.reset()
