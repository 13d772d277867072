"""cpu_experts: the routed-experts operator that runs on the CPU.

Contract: an experts operator takes hidden states [T, H], top-k expert ids [T, K] (an id of -1 means the
expert is computed elsewhere and contributes nothing here) and top-k weights [T, K], and returns
[T, H] = sum_k weight[t, k] * expert_{id[t, k]}(hidden[t]) with the SiLU-gated expert MLP.
`cpu_experts.reference` is the plain-PyTorch oracle; the packed INT8/INT4 kernels are tested against it.
"""
