"""Without a GPU, Triton kernels run under Triton's interpreter on CPU tensors (the kernel tests' CI mode). The
switch must be set before any kernel module is imported, since `@triton.jit` reads it when it decorates; the SM120
gate compiles from the kernels' Python functions in a subprocess and is not affected.

Triton 3.6's interpreter (with NumPy >= 2.3) has defects that the GPU does not, patched here for every test:
- a scalar is a 1-element array and `int()` of one is an error since NumPy 2.3, which breaks every loop with a
  run-time bound (`range(lo, hi, BLOCK)`); `__index__` is made to take the element;
- float32 -> float8/bfloat16 casts do not round (float8 even drops the mantissa carry: 124.4 becomes 64), so they
  go through torch, which rounds to nearest even like the GPU;
- tl.dot of bfloat16 multiplies the raw bits as integers, so bfloat16 operands are widened to float32 first.
"""

import os

import numpy as np
import pytest
import torch

IS_INTERPRETED = not torch.cuda.is_available()
if IS_INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Under pytest-xdist (the suite's two workers, one per core on CI): each worker computes on one torch thread,
    so the two workers' thread pools do not spin against each other on two cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def pytest_sessionstart(session):
    """numba's cache of the CPU kernels dropped if a kernel module changed since it was written (`compile_cache`):
    tests call kernels directly, before any of the runtime's entry points would."""
    from cpu_experts import compile_cache

    compile_cache.refresh()


@pytest.fixture(autouse=True)
def triton_interpreter_fixes(monkeypatch):
    if not IS_INTERPRETED:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    convert_float = interpreter._convert_float
    patch_lang_tensor = interpreter._patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot
    by_torch = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.uint16)}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype in by_torch and input_dtype == tl.float32:
            dtype, bits = by_torch[output_dtype]
            rounded = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(dtype)
            return rounded.view(bits).numpy().reshape(data.shape)
        return convert_float(data, input_dtype, output_dtype, rounding_mode)

    def widen(operand):
        if operand.dtype.scalar != tl.bfloat16:
            return operand
        data = convert_float(operand.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def patch_tensor(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_convert_float", convert)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot)
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_tensor)
