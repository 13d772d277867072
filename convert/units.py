"""Writing one unit of the plan to a temporary file, one tensor (or one expert) in memory at a time.

GPU units keep HuggingFace names: each tensor is copied as stored (its quantization parts too) or, with a GPU
quantizer, quantized into the compressed-tensors parts. Expert units write the stacked layout of
`cpu_experts.expert_file`, expert by expert, `threads` experts at a time: quantized from the source's (dequantized)
weights, or, for a source's own FP8 / MXFP4 / NVFP4 / INT4 (`convert.experts`), copied
(`hybrid.native_experts.projection_parts`, shared with the runtime that serves a checkpoint directly). A layer whose
experts are stored fused (gpt-oss, Qwen3.5: `Plan.fused`) is read expert by expert by its layout's reader
(`hybrid.fused_experts`, the runtime's too), with gpt-oss's biases.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from convert.plan import ROLES, Plan, Unit
from cpu_experts.expert_file import ExpertLayerSpec
from hybrid.native_experts import projection_parts
from hybrid.safetensors_io import SafetensorsWriter, TensorSpec


def write_gpu_unit(plan: Plan, unit: Unit, path: Path, quantizer) -> None:
    specs = [spec for name in unit.names for spec in quantizer.specs(plan, name)]
    writer = SafetensorsWriter(path, specs, {"format": "pt"})
    try:
        for name in unit.names:
            parts = quantizer.tensors(plan, name)
            while parts:  # popped, so no tensor outlives its write (embeddings can be gigabytes)
                writer.write(*parts.popitem())
    except BaseException:
        writer.abort()
        raise
    writer.close()



def write_expert_unit(plan: Plan, unit: Unit, path: Path, spec: ExpertLayerSpec, threads: int,
                      is_passthrough: bool = False) -> None:
    shapes = spec.tensor_shapes()
    specs = [TensorSpec(name, dtype, shape) for name, (shape, dtype) in shapes.items()]
    writer = SafetensorsWriter(path, specs, spec.metadata(unit.layer))

    fused = plan.fused.get(unit.layer)

    def one_expert(expert: int) -> None:
        # Experts are independent entries of every stacked tensor: workers write disjoint byte ranges. Rows are
        # quantized independently, so chunks of rows bound the float32 temporaries of each worker.
        if fused is not None:  # one expert's rows of the layer's fused tensors at a time
            for name, tensor in fused.expert_parts(plan.ckpt, expert, spec, is_passthrough, plan.check_finite):
                writer.write(name, tensor, row=expert)
            return
        for role in ROLES:
            name = plan.expert_name(unit.layer, expert, role)
            for part, tensor, first in projection_parts(plan.ckpt, name, role, spec, is_passthrough,
                                                        plan.check_finite):
                writer.write(f"{role}.{part}", tensor, row=expert, first=first)

    try:
        if threads == 1:
            for expert in range(spec.num_experts):
                one_expert(expert)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one_expert, range(spec.num_experts)))  # list(): re-raises a worker's error
    except BaseException:
        writer.abort()
        raise
    writer.close()
