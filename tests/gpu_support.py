"""Where the kernel tests run: the GPU when there is one, else CPU tensors under Triton's interpreter
(tests/conftest.py switches it on)."""

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IS_INTERPRETED = DEVICE.type == "cpu"


def poisoned(*shape, dtype=torch.float32) -> torch.Tensor:
    """An output buffer full of NaN: an element the kernel does not write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
