"""Shared layers that every model family is composed from.

Contract: layers take flattened token tensors [T, ...] (no batch dimension; sequences are concatenated) and
read per-step metadata from the `ForwardBatch` passed down through `forward`. Parameter names follow the
HuggingFace checkpoints so that loading is a copy. Math that later becomes a kernel calls a reference function
in `gpu_layers.reference` (attention) or `cpu_experts.reference` (routed experts) through a backend chosen once
at start-up (`hybrid.layers.backends`).
"""
