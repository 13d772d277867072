"""`LLM`: the Python API over one model: the model, its paged KV cache in cache groups (`hybrid.cache_groups`) and
the one set of per-group allocators that owns the cache's pages (`blocks`); its eager model runner
(`hybrid.model_runner`); full-prompt logits; and single-sequence generation, which runs through the model's engine
(`hybrid.engine.Engine`: the newest one built over this LLM, else one of its own), so pages, prefix cache, step
inputs and sampling have one implementation."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from cpu_experts.topology import allowed_cpus, discover_nodes, use_kernel_threads
from hybrid import parallel
from hybrid.block_manager import CacheGroupBlocks, OutOfBlocks, blocks_needed
from hybrid.cache_groups import derive_cache_groups
from hybrid.config import resolve_max_model_len
from hybrid.converted import cpu_executor, read_manifest
from hybrid.cpu_handoff import CpuHandoff
from hybrid.engine_config import EngineConfig
from hybrid.errors import ConfigError
from hybrid.forward_batch import SequenceSlice
from hybrid.hot_experts import HotExperts, SwapPolicy, check_hot_experts
from hybrid.kv_cache import allocate_kv_cache, allocate_state_cache, kv_cache_bytes, state_slot_bytes
from hybrid.layers.backends import Backends, uses_gemm_kernels
from hybrid.loader import load_weights
from hybrid.model_runner import ModelRunner
from hybrid.models import load_model_config
from hybrid.models.base import MoECausalLM
from hybrid.parallel import check_tensor_parallel
from hybrid.placement import (
    ExpertPlacement,
    MemoryPlan,
    RoutingRecorder,
    RoutingStats,
    activation_bytes,
    auto_gpu_experts,
    layerwise_step_tokens,
    resident_expert_bytes,
)
from hybrid.prefill_split import PrefillRates, measure_cpu, measure_link
from hybrid.rank_stats import RankCounters, RankStats, RankTable
from hybrid.routed_experts import RoutedExperts, cpu_experts_factory
from hybrid.sampling import NON_FINITE_LOGITS, SamplingParams
from hybrid.streaming import attach_streamed, min_streamed_tokens, reserve_bytes
from hybrid.tp_workers import Workers, is_worker, rank_device

log = logging.getLogger(__name__)


def build_model(cls: type[MoECausalLM], config, engine: EngineConfig, backends: Backends | None = None,
                tp: parallel.TensorParallel = parallel.SINGLE):
    """Builds the model without initialising weights (they are about to be overwritten by the loader); `tp`: this
    rank's shard of it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(engine.torch_dtype)
    try:
        with torch.device("meta"), parallel.building(tp):
            model = cls(config, backends)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=engine.device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty gives each name its own storage
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()  # non-persistent buffers computed from the config (e.g. RoPE frequencies)
    return model.eval()


class LLM:
    def __init__(self, path: str | Path, config: EngineConfig | None = None, **options):
        """`options` are `EngineConfig` fields (device="cuda", dtype="bfloat16", gpu_experts=16, ...); or pass a
        whole `config` (what the CLIs build)."""
        if config is not None and options:
            raise TypeError("pass either an EngineConfig or its fields as keywords, not both")
        self.engine_config = config or EngineConfig(**options)
        cls, self.config = load_model_config(path)
        self.workers: Workers | None = None  # rank 0 of a tensor-parallel LLM: the other ranks' processes
        self._num_torch_threads = torch.get_num_threads()
        self.tp = parallel.SINGLE  # this process's shard of the model (`hybrid.parallel`)
        if self.engine_config.tensor_parallel_size > 1:
            self.workers = self._join_ranks(path)
            self.tp = parallel.joined()
        try:
            self._build(path, cls)
            if self.workers is not None:
                self.workers.wait_ready()
        except BaseException:
            self._leave_ranks()
            raise

    def _build(self, path: str | Path, cls: type[MoECausalLM]) -> None:
        cfg = self.engine_config
        self.max_model_len = resolve_max_model_len(cfg.max_model_len, self.config)
        block_size = cfg.block_size
        num_blocks = blocks_needed(max(cfg.kv_cache_tokens or 4 * self.max_model_len, self.max_model_len), block_size)
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or min(512, self.max_model_len)
        if self.max_num_batched_tokens > self.max_model_len:
            raise ConfigError(f"max_num_batched_tokens {self.max_num_batched_tokens} exceeds max_model_len "
                              f"{self.max_model_len}; lower it or raise max_model_len")
        # Placement, decided once: a converted directory's routed experts run on the CPU operator (some of them on
        # the GPU with gpu_experts), and so do a plain checkpoint's with expert_placement cpu (auto on CUDA), read
        # from it at load; otherwise they run through the PyTorch reference on the engine's device.
        has_experts = self.config.num_moe_layers > 0
        is_cpu_experts = has_experts and (read_manifest(Path(path)) is not None or cfg.is_cpu_placement)
        if not has_experts:
            log.info("%s has no routed experts: every layer runs on %s, none are placed on the CPU operator",
                     self.config.architecture, cfg.device)
        tp = self.tp
        nodes, cpus, num_threads = self._cpu_threads(is_cpu_experts)
        moe = self.config.moe
        self.gpu_prefill_tokens = min_streamed_tokens(cfg, moe.num_experts, moe.top_k) if is_cpu_experts else 0
        self.num_gpu_experts = 0
        make_experts = None
        # the one path from MoE layers to their CPU experts; the runner sets its step mode
        self.cpu_handoff = CpuHandoff() if is_cpu_experts else None
        # planned on the meta device once, and only where an "auto" setting asks for it
        plan = functools.cache(partial(self._memory_plan, cls, num_blocks))
        # the scheduler's budget: max_num_batched_tokens, or a layer-wise prefill's (`_resolve_step_tokens`)
        self.max_step_tokens = self._resolve_step_tokens(plan)
        if is_cpu_experts:
            self.num_gpu_experts = self._resolve_gpu_experts(cls, plan)
            if cfg.hot_experts_interval:
                check_hot_experts(cfg.hot_experts_interval, cfg.hot_experts_swaps, self.num_gpu_experts,
                                  moe.num_experts)
            make_experts = self._cpu_experts_factory(self.num_gpu_experts)
        elif cfg.hot_experts_interval:  # nothing to move: every expert is on the device already
            raise ConfigError(f"hot_experts_interval {cfg.hot_experts_interval} moves experts between the CPU and the "
                              f"GPU, and this model has no CPU experts (expert_placement {cfg.expert_placement}): "
                              "set hot_experts_interval 0")
        top_k = moe.top_k if has_experts else 0
        if cfg.defer_experts and cfg.defer_experts >= top_k:
            raise ConfigError(f"defer_experts {cfg.defer_experts} must be below the model's top-k routing ({top_k}"
                              f"{'' if has_experts else ': no routed experts'}); set defer_experts 0")
        if cfg.record_routing and not has_experts:
            raise ConfigError(f"record_routing: {self.config.architecture} has no routed experts to record; leave "
                              "record_routing unset")
        backends = Backends.for_device(cfg.device, self.config, block_size, cfg.torch_dtype, cfg.kernels,
                                       make_experts, cfg.defer_experts)
        if cfg.tensor_parallel_size > 1:  # quantized dense weights are dequantized at load, then split
            backends = replace(backends, keep_quantized=False)
        self.backends = backends
        self.model = build_model(cls, self.config, cfg, backends, self.tp)
        load_weights(self.model, path, cfg.numa_partitions or len(nodes), keep_quantized=backends.keep_quantized,
                     expert_dtype=cfg.expert_dtype, rank=tp.rank, num_ranks=tp.size)
        for module in self.model.modules():
            if hasattr(module, "fuse_gate_up"):
                module.fuse_gate_up()  # the kernels' stacked gate/up layout (MLPs: only when the ops use it)
            if hasattr(module, "fuse_qkv"):
                module.fuse_qkv()  # attention's q/k/v as one GEMV (only with the kernels' ops)
        streamed = [m.streamed for m in self.model.modules() if isinstance(m, RoutedExperts) and m.streamed]
        self.expert_stream, self.num_pinned_bytes = attach_streamed(streamed, cfg.device) if streamed else (None, 0)
        self._measure_prefill_rates([m for m in streamed if m.stream is not None])
        self._start_cpu_side(is_cpu_experts, cpus, num_threads)
        self._allocate_caches(num_blocks)
        self.engine = None  # what generate() runs through: the newest Engine(self), else one generate() builds
        self._owns_engine = False
        self.num_forward_tokens = 0
        # this rank's metrics, published into its row of the ranks' table (`hybrid.rank_stats`)
        table = parallel.rank_table() if tp.size > 1 else RankTable(1, is_shared=False)
        self.counters = RankCounters(table, tp.rank, cfg.device)
        self.counters.publish()  # the memory of the weights and the KV cache, before any step
        self.runner = ModelRunner(self)  # eager: prefill_logits, and the engines that capture no graphs

    def _cpu_threads(self, is_cpu_experts: bool) -> tuple[list, list[int], int | None]:
        """This rank's NUMA nodes and CPUs, and the CPU experts' kernel threads, set now (before loading runs a
        kernel): a tensor-parallel rank's experts run on its share of the nodes but its host CPU
        (`topology.rank_cpus`); on CUDA one process's leave one CPU to the thread driving the GPU."""
        cfg, tp = self.engine_config, self.tp
        if tp.size > 1:  # the rank's share, found before its threads were pinned (`hybrid.tp_workers`)
            share = parallel.rank_cpus()
            nodes, cpus = list(share.nodes), share.kernels  # on CUDA without the rank's host CPU
            num_threads = len(cpus) if is_cpu_experts else None
        else:
            nodes, cpus = discover_nodes(), allowed_cpus()
            num_threads = max(1, len(cpus) - 1) if is_cpu_experts and cfg.is_cuda else None
        use_kernel_threads(num_threads)
        if tp.size > 1 and not cfg.is_cuda:  # the ranks' dense layers share the cores as their experts do
            torch.set_num_threads(len(cpus))
        return nodes, cpus, num_threads

    def _start_cpu_side(self, is_cpu_experts: bool, cpus: list[int], num_threads: int | None) -> None:
        """After loading: the routing recorder, hot experts, and the CPU experts' executor thread (overlapped with
        the shared experts; on CUDA leaving one CPU to the thread that drives the GPU)."""
        cfg = self.engine_config
        if cfg.is_cuda and num_threads is not None:
            # torch's own OpenMP pool, once woken by a CPU op, spins on the cores the expert kernels need: on the
            # H200 host the in-engine decode call took 0.76 ms with it and 0.54 ms with one torch thread
            torch.set_num_threads(1)
        self.routing_recorder: RoutingRecorder | None = None
        if cfg.record_routing:
            self.record_routing()
        self.hot_experts: HotExperts | None = None  # the engine calls it between steps
        if is_cpu_experts and cfg.hot_experts_interval:
            layers = [m for m in self.model.modules() if isinstance(m, RoutedExperts) and m.free_slots()]
            self.hot_experts = HotExperts(layers, self.record_routing(), cfg.hot_experts_interval,
                                          SwapPolicy(max_swaps=cfg.hot_experts_swaps), cfg.device)
        self.cpu_executor = None
        if is_cpu_experts:
            self.cpu_executor = cpu_executor(self.model, self.max_model_len, torch.float32, num_threads,
                                             worker_cpus=cpus if self.tp.size > 1 else None)
            self.cpu_handoff.executor = self.cpu_executor

    def _allocate_caches(self, num_blocks: int) -> None:
        """The one owner of this model's KV pages (every engine over it and prefill_logits take pages from it),
        the KV cache and the recurrent-state pools."""
        cfg = self.engine_config
        groups = self._cache_groups(self.model, num_blocks)
        is_recurrent = self.config.has_recurrent_layers
        if is_recurrent and cfg.enable_prefix_caching and not self.num_state_snapshots:
            # a hit needs the recurrent states as they were at the hit's last page: none are kept
            log.info("%s has recurrent (Gated DeltaNet) layers and state_snapshots is 0: prefix caching is off",
                     self.config.architecture)
        self.blocks = CacheGroupBlocks(groups, cfg.block_size, cfg.enable_prefix_caching, self.num_state_slots,
                                       self.num_state_snapshots)
        self.kv_caches = allocate_kv_cache(self.model.attention_layers(), groups, cfg.block_size, cfg.torch_dtype,
                                           cfg.device)
        self.state_caches = allocate_state_cache(self.model.state_layers(), self.num_state_slots,
                                                 self.num_state_snapshots, cfg.torch_dtype,
                                                 cfg.device) if is_recurrent else []

    def _join_ranks(self, path: str | Path) -> Workers | None:
        """Tensor parallel: rank 0 checks the setting, starts the other ranks and joins them (`hybrid.tp_workers`),
        which returns their handle; a rank it started (`is_worker`) has joined already. Either way the engine config
        takes this rank's device."""
        cfg = self.engine_config
        workers = None
        if not is_worker():
            if parallel.is_initialized():
                raise RuntimeError("a tensor-parallel LLM is open in this process: close() it before opening another")
            check_tensor_parallel(self.config, cfg, read_manifest(Path(path)) is not None)
            workers = Workers(path, cfg)
        tp = parallel.joined()
        self.engine_config = replace(cfg, device=rank_device(cfg.device, tp.rank))
        return workers

    def rank_stats(self) -> tuple[RankStats, ...]:
        """Every rank's numbers as each last published them (`hybrid.rank_stats`), rank 0 first (one for a
        one-process LLM): rank 0's server reads them from any thread, without waiting for the engine or a worker."""
        table = self.counters.table
        is_alive = (True, *(self.workers.alive() if self.workers is not None else ()))
        return tuple(table.read(rank, is_alive[rank]) for rank in range(len(is_alive)))

    def _leave_ranks(self) -> None:
        """Rank 0: the workers stopped and joined, the process groups left, torch's threads as they were."""
        if self.workers is not None:
            self.workers.stop()
            torch.set_num_threads(self._num_torch_threads)

    @property
    def num_state_slots(self) -> int:
        """Recurrent-state slots of a model with recurrent layers (one per request the engine runs), else 0."""
        return self.engine_config.max_num_seqs if self.config.has_recurrent_layers else 0

    @property
    def num_state_snapshots(self) -> int:
        """Prefix caching's recurrent-state snapshots (`state_snapshots`, default one per state slot; rows of the
        state pools after the slots), 0 without recurrent layers or prefix caching."""
        cfg = self.engine_config
        if not self.config.has_recurrent_layers or not cfg.enable_prefix_caching:
            return 0
        return cfg.max_num_seqs if cfg.state_snapshots is None else cfg.state_snapshots

    def _cache_groups(self, model, num_full_blocks: int):
        cfg = self.engine_config
        return derive_cache_groups(model.attention_layers(), num_full_blocks, cfg.block_size, cfg.max_num_seqs,
                                   self.max_step_tokens)

    def record_routing(self) -> RoutingRecorder:
        """Starts counting the experts each MoE layer routes to; `recorder.stats().write(path)` saves them for
        `routing_stats=` (GPU-resident experts) of a later run; with `record_routing=FILE`, `close()` does."""
        if not self.config.num_moe_layers:
            raise ConfigError(f"{self.config.architecture} has no routed experts: there is no routing to record")
        if self.routing_recorder is None:
            self.routing_recorder = RoutingRecorder(self.config.moe.num_experts)
            self.routing_recorder.attach(self.model)
        return self.routing_recorder

    def close(self) -> None:
        """Writes the routing statistics (`record_routing=FILE`), stops the CPU experts' executor, unpins the
        streamed experts' weights and, tensor parallel, stops the other ranks."""
        if self.routing_recorder is not None and self.engine_config.record_routing:
            self.routing_recorder.stats().write(self.engine_config.record_routing)
        if self.engine is not None:  # the caller's too: its graphs must go before the ranks are left
            self.engine.close()  # detaches it
        if self.hot_experts is not None:
            self.hot_experts.close()
        if self.cpu_executor is not None:
            self.cpu_executor.close()
        if self.expert_stream is not None:
            self.expert_stream.unpin()
        self._leave_ranks()

    def _resolve_gpu_experts(self, cls: type[MoECausalLM], plan: Callable[[], MemoryPlan]) -> int:
        """`gpu_experts` as a count: "auto" fills the device memory left after the dense weights, the KV cache and
        a reserve for activations (estimated on the meta device, before anything is allocated)."""
        cfg = self.engine_config
        if not cls.has_resident_experts:
            if cfg.gpu_experts == "auto":
                log.info("%s: routed experts run on the CPU operator only; gpu_experts=auto places none on the "
                         "device", self.config.architecture)
                return 0
            if cfg.gpu_experts:
                raise ConfigError(f"{self.config.architecture}: routed experts run on the CPU operator or all on "
                                  "the device; set gpu_experts=0 (--gpu-experts 0) or expert_placement=device")
        if cfg.gpu_experts != "auto":
            return cfg.gpu_experts
        if not cfg.is_cuda:
            return 0
        memory = plan()
        fits = auto_gpu_experts(self.config, memory.budgets,
                                memory.dense_bytes + memory.kv_bytes(self.max_step_tokens),
                                activation_bytes(self.config, self.max_model_len) + memory.streaming_bytes,
                                cfg.torch_dtype.itemsize)
        return fits if cfg.max_gpu_experts is None else min(fits, cfg.max_gpu_experts)

    def _resolve_step_tokens(self, plan: Callable[[], MemoryPlan]) -> int:
        """The tokens one engine step may take: `max_num_batched_tokens`, or more where routed experts stream to the
        GPU for prefill (`layerwise_prefill_tokens`; "auto": as many as the GPU memory holds beside the weights, the
        KV cache and the `gpu_experts` count, which "auto" experts then fill around)."""
        cfg = self.engine_config
        tokens = cfg.layerwise_prefill_tokens
        if tokens != "auto":
            if tokens > self.max_model_len:
                raise ConfigError(f"layerwise_prefill_tokens {tokens} exceeds max_model_len {self.max_model_len}; "
                                  "lower it, or use auto")
            return max(tokens, self.max_num_batched_tokens)
        if not self.gpu_prefill_tokens:  # nothing streams: a longer step would reuse nothing
            return self.max_num_batched_tokens
        memory = plan()
        num_resident = 0 if cfg.gpu_experts == "auto" else -(-cfg.gpu_experts // self.tp.size)  # this rank's share
        resident = resident_expert_bytes(self.config, num_resident, cfg.torch_dtype.itemsize)
        fits = layerwise_step_tokens(
            memory.budgets, lambda t: memory.dense_bytes + resident + memory.kv_bytes(t) + memory.streaming_bytes
            + activation_bytes(self.config, t), self.max_num_batched_tokens, self.max_model_len)
        log.info("layer-wise prefill: steps of up to %d tokens (each streamed expert crosses PCIe once a step)", fits)
        return fits

    def _memory_plan(self, cls: type[MoECausalLM], num_blocks: int) -> MemoryPlan:
        """What the device memory holds before any routed expert is placed on it, planned on the meta device:
        every rank's budget (rank r on cuda:r: each rank computes the same list, so they agree), this rank's dense
        weights, its KV cache and state pools for a step budget (windowed groups grow with it), streaming's ring."""
        cfg = self.engine_config
        budgets = [int(torch.cuda.get_device_properties(rank_device(cfg.device, r)).total_memory
                       * cfg.gpu_memory_utilization) for r in range(self.tp.size)]
        meta = build_model(cls, self.config, replace(cfg, device="meta"),
                           Backends(make_experts=partial(cpu_experts_factory, handoff=CpuHandoff())), self.tp)
        dense_bytes = sum(t.numel() * t.element_size() for t in itertools.chain(meta.parameters(), meta.buffers()))
        state_bytes = state_slot_bytes(meta.state_layers(), cfg.torch_dtype) * (self.num_state_slots
                                                                                + self.num_state_snapshots)

        def kv_bytes(step_tokens: int) -> int:
            groups = derive_cache_groups(meta.attention_layers(), num_blocks, cfg.block_size, cfg.max_num_seqs,
                                         step_tokens)
            return kv_cache_bytes(groups, cfg.block_size, cfg.torch_dtype) + state_bytes

        moe = self.config.moe
        streaming = reserve_bytes(moe.num_experts, self.config.hidden_size, moe.intermediate_size) \
            if self.gpu_prefill_tokens else 0
        return MemoryPlan(budgets, dense_bytes, kv_bytes, streaming)

    def _cpu_experts_factory(self, num_gpu_experts: int):
        """Each MoE layer's `RoutedExperts`: the CPU operator, less the experts `gpu_experts` keeps on the engine's
        device (placement chosen here, once: hot experts then move it, `hybrid.hot_experts`, keeping
        `hot_experts_swaps` of the slots spare), with streamed prefill where `gpu_prefill_tokens` asks for it."""
        cfg = self.engine_config
        placement = None
        num_spare = cfg.hot_experts_swaps if cfg.hot_experts_interval and num_gpu_experts else 0
        if num_gpu_experts:
            stats = RoutingStats.read(cfg.routing_stats) if cfg.routing_stats else None
            placement = ExpertPlacement.choose(self.config.moe_layer_indices, self.config.moe.num_experts,
                                               num_gpu_experts - num_spare, stats, num_ranks=self.tp.size)
        return partial(cpu_experts_factory, handoff=self.cpu_handoff, placement=placement, rank=self.tp.rank,
                       int8_activations=cfg.expert_activations == "int8",
                       is_fused=uses_gemm_kernels(cfg.device, cfg.kernels, cfg.torch_dtype),
                       min_streamed_tokens=self.gpu_prefill_tokens, device=cfg.device, num_spare_slots=num_spare,
                       prefill_cpu_share=cfg.cpu_share)

    def _measure_prefill_rates(self, streamed: list) -> None:
        """The rates every streamed layer's split is costed from (`hybrid.prefill_split`), measured once after
        loading where the split is "auto": the link's, and the CPU operator's on the first streamed layer."""
        if not streamed or self.engine_config.cpu_share is not None:
            return
        rates = PrefillRates(link_bytes_per_s=measure_link(self.engine_config.device))
        with torch.inference_mode():
            rates = measure_cpu(streamed[0].cpu_experts, self.config.moe.top_k, rates)
        log.info("prefill split rates: %s", rates)
        for module in streamed:
            module.rates = rates

    def attach_engine(self, engine) -> None:
        """`Engine.__init__` calls this: the newest engine over the model is the one `generate` runs through (one
        that generate() built for itself is closed; one the caller built is the caller's to close)."""
        if self._owns_engine:
            self.engine.close()
        self.engine, self._owns_engine = engine, False

    def detach_engine(self, engine) -> None:
        """`Engine.close` calls this: generate() builds an engine of its own next time, if `engine` was its one."""
        if self.engine is engine:
            self.engine, self._owns_engine = None, False

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of a fresh sequence (its pages are not published to the prefix
        cache). One step where every cache group has the pages; else in chunks as large as the sliding-window
        groups' free pages allow, their out-of-window pages given back between chunks."""
        self._check_prompt(token_ids, 0)
        tables, num_computed, logits = self.blocks.new_tables(), 0, []
        slots = self.blocks.state_slots
        state_slot = slots.allocate() if slots is not None else -1
        if state_slot is None:
            raise OutOfBlocks("prefill_logits: no free recurrent-state slot (the engine's requests hold them); "
                              "finish them first")
        try:
            while num_computed < len(token_ids):
                self.blocks.release_out_of_window(tables, num_computed)
                num_new = self.blocks.fit(tables, num_computed, len(token_ids) - num_computed)
                if num_new == 0:
                    raise OutOfBlocks(f"prefill_logits of {len(token_ids)} tokens: no free KV pages (the engine's "
                                      f"requests hold them); finish them first")
                self.blocks.allocate(tables, num_computed + num_new)
                seq = SequenceSlice(num_computed, num_new, tables, state_slot)
                logits.append(self.runner.execute([seq], token_ids[num_computed:num_computed + num_new]))
                self.runner.finish_step()  # the step's numbers published (`hybrid.rank_stats`)
                num_computed += num_new
        finally:
            self.blocks.free(tables)
            if slots is not None:
                slots.free(state_slot)
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def generate(self, token_ids: list[int], max_new_tokens: int = 16, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False) -> list[int]:
        """New token ids (greedy unless temperature > 0); stops at EOS unless ignore_eos, or at stop_token_ids.
        Runs one request through the model's engine, which must have no other requests in flight."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
        self._check_prompt(token_ids, max_new_tokens)
        if max_new_tokens == 0:
            return []
        engine = self._engine_for_generate()
        request_id = engine.add_request(token_ids, params, max_new_tokens, stop_token_ids=stop_token_ids,
                                        ignore_eos=ignore_eos)
        try:
            while engine.has_work():
                engine.step()
        finally:
            engine.finish(request_id, "cancelled")  # an interrupted step: its pages go back (no-op once finished)
            request = engine.requests.pop(request_id)
        if request.finish_reason == "error":
            raise RuntimeError(f"generation failed: {NON_FINITE_LOGITS}")
        return request.output_ids

    def _engine_for_generate(self):
        from hybrid.engine import Engine

        if self.engine is None:
            # one request at a time, its prompt in one step (max_model_len tokens), decoded eagerly: what generate()
            # always computed (graph steps size their decode grids by max_model_len, another summation order)
            Engine(self, max_num_batched_tokens=self.max_model_len, max_num_seqs=1, allow_cuda_graphs=False)
            self._owns_engine = True
        if self.engine.has_work():
            raise RuntimeError(f"LLM.generate needs the model's engine idle; it has "
                               f"{len(self.engine.scheduler.running) + len(self.engine.scheduler.waiting)} requests "
                               f"in flight: add this prompt with engine.add_request and step the engine instead")
        return self.engine

    def _check_prompt(self, token_ids: list[int], max_new_tokens: int) -> None:
        if not token_ids:
            raise ValueError("token_ids is empty: a prompt needs at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        bad = [t for t in token_ids if not 0 <= int(t) < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(token_ids) + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens + max_new_tokens {max_new_tokens} exceeds max_model_len "
                f"{self.max_model_len}; pass a larger max_model_len to LLM(...)"
            )
