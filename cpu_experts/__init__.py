"""cpu_experts: the routed-experts operator that runs on the CPU.

Contract: an experts operator takes hidden states [T, H], top-k expert ids [T, K] (an id of -1 means the
expert is computed elsewhere and contributes nothing here) and top-k weights [T, K], and returns
[T, H] = sum_k weight[t, k] * expert_{id[t, k]}(hidden[t]) with the SiLU-gated expert MLP.

Data flow: an expert file (`expert_file`: the converter's canonical layout, quantized by `formats`) -> `packed`
(split along I into partitions, one per NUMA node from `topology`, or forced; a tensor-parallel rank keeps its
slice of I first, on its share of the nodes, `topology.rank_nodes`; in huge-page `memory`) ->
`operator.CpuMoE` (routing; decode: numba streaming kernels, integer `kernels_vnni` on CPUs with VNNI, else float
`kernels`; prefill: grouped matmuls, our AMX kernels in `prefill_amx` for per-channel int8 where the CPU has AMX,
oneDNN in `prefill_int8` elsewhere, dequantize-and-multiply in `prefill` for the other formats) ->
`module.CpuExperts`, the experts-backend module the models use.
Quantized experts compute with int8 activations by default (W8A8, one scale per row; `int8_activations=False` for
float activations); FP8 experts (`kernels_fp8`) on bf16-rounded activations always, as the format is published.
`executor` runs an operator asynchronously (submit / sync over fixed, pinnable buffers) so the engine can overlap
it with GPU work; `flag_worker` serves a CUDA graph's hand-off flags on the executor's thread, and `decode_pool`
serves them from pinned spinning threads in compiled code (int8 W8A8 decode; `atomics` for the shared words).
`reference` is the plain-PyTorch oracle the kernels are tested against. Nothing here imports the engine
(`hybrid`).
"""
