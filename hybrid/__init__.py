"""hybrid: CPU/GPU hybrid inference for large Mixture-of-Experts models.

Data flow: a HuggingFace checkpoint directory -> `config.ModelConfig` (parsed once) -> a model from the
architecture registry (`models`) built from shared layers (`layers`) -> weights copied in by `loader` -> `LLM`
runs prefill and decode steps over a paged KV cache (`kv_cache`), one `ForwardBatch` of metadata per step.
Attention goes through an attention backend (`gpu_layers` references on the CPU), routed experts through an
experts backend (`cpu_experts`), so the kernels of later work plug in without touching the models.
"""

__all__ = ["LLM"]


def __getattr__(name: str):
    # Imported lazily so that `import hybrid` (e.g. by the CLI stubs) does not pull in torch.
    if name == "LLM":
        from hybrid.llm import LLM

        return LLM
    raise AttributeError(name)
