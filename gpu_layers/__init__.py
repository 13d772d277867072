"""gpu_layers: attention and dense-layer kernels with a plain-PyTorch reference beside each.

Contract: functions take plain tensors and ints (never model objects). `gpu_layers.reference` is the oracle the
kernels are tested against and the path used on the CPU. Paged KV caches are [num_blocks, block_size, heads, dim];
sequences are concatenated along the token axis and described by block tables, lengths and slot mappings.
"""
