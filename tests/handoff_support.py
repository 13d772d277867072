"""The device side of the CUDA-graph hand-off, played on the host by a Python thread (what GraphHandoff's captured
copies and kernels do), for the tests of the CPU side: `cpu_experts.flag_worker` and `cpu_experts.decode_pool`."""

from __future__ import annotations

import time

import torch

from cpu_experts.flag_worker import DONE, REQUEST, FlagWorker


def play_gpu(worker: FlagWorker, layers: list[int], hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             timeout_s: float = 10) -> list[torch.Tensor]:
    """One step: per layer, copy in (hidden scaled by layer + 1), post the layer, wait for done, clear it, copy out."""
    num_tokens, outputs = hidden.shape[0], []
    for layer in layers:
        worker.hidden_buffer[:num_tokens] = hidden * (layer + 1)
        worker.ids_buffer[:num_tokens] = ids
        worker.weights_buffer[:num_tokens] = weights
        worker.flags[REQUEST] = layer + 1
        deadline = time.monotonic() + timeout_s
        while int(worker.flags[DONE]) != layer + 1:
            assert time.monotonic() < deadline, f"layer {layer} was never served"
        worker.flags[DONE] = 0
        outputs.append(worker.out_buffer[:num_tokens].clone())
    return outputs
