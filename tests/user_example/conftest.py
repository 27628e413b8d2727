# A user's project loads the plugin with `pytest -p compilepack.testing` (or `pytest_plugins = ["compilepack.testing"]`
# in its root conftest.py). Nested inside compilepack's own tests, where only the root conftest may declare
# plugins, this directory imports the plugin's fixtures instead; tests/test_check_plugin.py runs the same files
# the user's way, with -p.
from compilepack.testing import compilepack_batch_factory, compilepack_model_factory  # noqa: F401
