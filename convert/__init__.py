"""convert: `hybrid-convert` splits a HuggingFace checkpoint into GPU weights and quantized CPU experts.

Contract: reads any checkpoint `hybrid.loader` can read and writes a self-describing directory whose format
definitions are shared with `cpu_experts`.
"""
