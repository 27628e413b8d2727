"""Run the real fla and mamba-ssm Triton kernels on CPU tensors, under Triton's interpreter.

Only for the kernel stage of CI (``.ci/run``), in its own virtual environment (``tests/kernels/install.sh``):
triton, fla-core / flash-linear-attention and mamba-ssm (built without its CUDA extensions). The main suite has
none of them and does not collect this folder (``tests/conftest.py``: only with ``TRITON_INTERPRET=1``).

Everything the interpreter needs lives here, none of it in the package (measured with torch 2.13.0 CPU, triton
3.9.0, fla 0.6.0, mamba-ssm 2.3.2.post1):

- ``TRITON_INTERPRET=1`` in the environment of the pytest process (triton reads it when kernels are decorated,
  at import), so the tests skip without it;
- autotuning benchmarks every config on a driver the interpreter does not have ("0 active drivers"): keep the
  first config only;
- the interpreter hands ``for i in range(n)`` loop variables to a kernel as Python ints, while fla calls
  ``i_t.to(tl.int64)`` on them: a rewrite of the kernel source turns them into interpreter tensors first
  (triton's interpreter AST transformer, a private API);
- ``torch.cuda.device(index)`` on CPU tensors (index None) and mamba-ssm's question for the SM count of the
  device, answered with an H100/H200's 132.
The interpreter computes bf16 on raw uint16 bits, so only fp32 is tested here; bf16 is for the GPU check.
"""

from __future__ import annotations

import ast
import contextlib
import os
import types

import pytest
import torch

try:
    import triton.runtime.interpreter as interpreter
    from triton.runtime import autotuner
except ImportError:  # run outside the kernel environment: every test here is skipped (below)
    interpreter = autotuner = None

SM_COUNT = 132


class _LoopVariablesAsTensors(interpreter.ASTTransformer if interpreter else object):
    """``for i in range(...)`` / ``tl.range(...)``: rebind ``i`` to an interpreter tensor at the top of the body."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        call = node.iter
        name = getattr(call.func, "attr", getattr(call.func, "id", None)) if isinstance(call, ast.Call) else None
        if isinstance(node.target, ast.Name) and name == "range":
            semantic = ast.Attribute(ast.Name("interpreter_semantic", ast.Load()), "to_tensor", ast.Load())
            value = ast.Call(semantic, [ast.Name(node.target.id, ast.Load()), ast.Constant(False)], [])
            node.body.insert(0, ast.Assign([ast.Name(node.target.id, ast.Store())], value))
        return node


def pytest_collection_modifyitems(config, items):
    if interpreter is None or os.environ.get("TRITON_INTERPRET") != "1":
        skip = pytest.mark.skip(reason="kernel stage only: TRITON_INTERPRET=1 in tests/kernels/install.sh's venv")
        for item in items:
            if "kernels" in item.nodeid.split("/"):
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def triton_interpreter_on_cpu():
    if interpreter is None:
        yield
        return
    patches = pytest.MonkeyPatch()
    patches.setattr(interpreter.FunctionRewriter, "ast_transformer", _LoopVariablesAsTensors())
    patches.setattr(autotuner.Autotuner, "prune_configs", lambda self, kwargs, *args, **kw: self.configs[:1])
    real_device = torch.cuda.device
    patches.setattr(torch.cuda, "device",
                    lambda index: contextlib.nullcontext() if index is None else real_device(index))
    patches.setattr(torch.cuda, "get_device_properties",
                    lambda device=None: types.SimpleNamespace(multi_processor_count=SM_COUNT))
    yield
    patches.undo()
