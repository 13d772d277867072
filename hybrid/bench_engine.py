"""`hybrid-bench decode` and `hybrid-bench prefill`: the engine on a converted model against its bound.

The model is a converted directory (`--model`) or a synthetic one built and converted on the fly by shape
(`--synthetic qwen3-30b-a3b --layers 2`, cached under `--workdir`). Decode: `--batch` requests, each a prompt of
`--context` tokens (default a short one) then `--tokens` decode steps, sampled; prefill: one prompt of `--tokens`
tokens. Per step the wall time is split into the CPU experts' compute (timed on the threads that run them) and the
rest; the bound of a decode step is the routed experts' bytes read per step over the memory read bandwidth measured
in the same run, just before and just after the timed steps (`cpu_experts.bench.ReadBandwidth`), plus the time
outside the CPU experts that does not overlap them (on a CPU-only machine: all of it). The physical bound is the
experts' bytes over that bandwidth alone (no GPU time): what no placement of the GPU work can beat.

`--guided-json [SCHEMA]` (decode): the same decode without and with a JSON schema constraining every request
(`hybrid.guided`; SCHEMA a file or JSON text, by default an array of objects too long to end within the run),
alternated twice, each run exactly `--tokens` steps: both rates and their ratio, the grammar masks' cost. A
synthetic model gets a tokenizer of its vocabulary's size for it (`hybrid.synthetic_tokenizer`), saved beside it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from cpu_experts.bench import ReadBandwidth, last_level_cache_bytes
from cpu_experts.module import CpuExperts
from cpu_experts.topology import allowed_cpus, physical_cores, use_kernel_threads
from hybrid.bench_gpu_alone import cpu_experts_answer_at_once, decode_pool_of, print_profile, profile_decode
from hybrid.bench_guided import attach_tokenizer, guided_spec
from hybrid.cli_args import add_arguments, from_namespace
from hybrid.engine import Engine, HostSeconds
from hybrid.engine_config import EngineConfig
from hybrid.layers.moe import SparseMoE
from hybrid.llm import LLM
from hybrid.prefill_split import measure_link
from hybrid.rank_stats import cpu_seconds_by_rank
from hybrid.routed_experts import RoutedExperts
from hybrid.sampling import GuidedSpec, SamplingParams
from hybrid.synthetic import SHAPES, write_synthetic_checkpoint, write_synthetic_converted
from hybrid.synthetic_routing import SkewedRouting

DECODE_PROMPT_TOKENS = 16  # each decode request's prompt, by default
LONG_CONTEXT_CHUNK = 8192  # prefill chunk of a long decode context (`--context`)
# Decode samples: a synthetic model decoding greedily tends to repeat one token, so every step would route to the
# experts of the step before and read them from the last-level cache (300 MB on the H200 host), not from memory.
DECODE_SAMPLING = SamplingParams(temperature=1.0, seed=0)
GUIDED_ROUNDS = 2  # --guided-json: decode runs without and with the schema, alternated
HOST_PHASES = tuple(f.name for f in fields(HostSeconds))  # the engine's step phases, as `HostSeconds` names them


def converted_model(args) -> Path:
    if args.model:
        if args.skewed_routing:
            raise SystemExit("--skewed-routing writes a synthetic model: leave out --model")
        return Path(args.model)
    from convert.cli import main as convert

    skew = SkewedRouting(tokens_per_shift=args.skewed_routing) if args.skewed_routing else None
    tag = f"-skew{args.skewed_routing}" if skew else ""

    workdir = Path(args.workdir or tempfile.gettempdir()) / "hybrid-bench-engine"
    group = [] if args.group_size is None else ["--group-size", str(args.group_size)]
    name = f"{args.synthetic}-{args.layers}l{tag}-{args.expert_dtype}{''.join(group[1:]) and f'-g{args.group_size}'}"
    if args.no_source:
        dst = workdir / f"{name}-direct"
        if not (dst / "hybrid.json").exists():
            default_group = 128 if args.expert_dtype == "int4" else 0  # hybrid-convert's defaults
            write_synthetic_converted(dst, args.synthetic, args.layers, args.expert_dtype,
                                      default_group if args.group_size is None else args.group_size, skew=skew)
        return dst
    src = workdir / f"{args.synthetic}-{args.layers}l{tag}"
    dst = workdir / name
    if not (src / "config.json").exists():
        write_synthetic_checkpoint(src, args.synthetic, args.layers, skew=skew)
    if not (dst / "hybrid.json").exists():
        convert([str(src), str(dst), "--expert-dtype", args.expert_dtype, *group])
    return dst


@dataclass
class CpuExpertsTimer:
    """Seconds and calls of every CpuExperts' compute since the last `reset` (`timed_cpu_experts` installs it)."""

    seconds: float = 0.0
    calls: int = 0
    rank_seconds: tuple[float, ...] = ()  # each rank's CPU-experts seconds in the last timed steps (`_time_steps`)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def timed_cpu_experts(llm: LLM) -> CpuExpertsTimer:
    """Wraps every CpuExperts' compute so that the returned timer adds up its seconds and calls."""
    timer = CpuExpertsTimer()
    for module in llm.model.modules():
        if isinstance(module, CpuExperts):
            compute = module.compute

            def timed(*args, _compute=compute):
                start = time.perf_counter()
                _compute(*args)
                timer.seconds += time.perf_counter() - start
                timer.calls += 1

            module.compute = timed
    return timer


def hot_call_seconds(llm: LLM, engine: Engine, num_tokens: int, repeats: int = 50) -> float | None:
    """The median time of the first layer's CPU-experts call on the last staged decode inputs, repeated back to
    back: the kernels' own speed with warm threads (and the layer's weights partly in cache), to set against the
    in-engine time per call, which pays the threads' wake-up after each GPU stretch."""
    module = next((m for m in llm.model.modules() if isinstance(m, CpuExperts) and m.op is not None), None)
    source = engine.runner.graphs.worker if engine.runner.graphs is not None else llm.cpu_executor
    if module is None or source is None:
        return None
    inputs = [b[:num_tokens].clone() for b in (source.hidden_buffer, source.ids_buffer, source.weights_buffer)]
    times = []
    for _ in range(repeats + 5):
        start = time.perf_counter()
        module.op(*inputs)
        times.append(time.perf_counter() - start)
    return sorted(times[5:])[repeats // 2]


def expert_bytes_per_step(llm: LLM, num_tokens: int) -> float:
    """Routed experts' bytes one step reads on the CPU: the expected distinct CPU-resident experts of `num_tokens`
    uniformly routed tokens (prefill: the bound is the read alone, a floor; its arithmetic is `hybrid-bench
    cpu-moe`'s). GPU-resident experts (`gpu_experts`) are not read by the CPU."""
    if not llm.config.num_moe_layers:  # a dense model: nothing on the CPU
        return 0.0
    num_experts, top_k = llm.config.moe.num_experts, llm.config.moe.top_k
    is_routed = 1 - (1 - top_k / num_experts) ** num_tokens  # chance that a given expert gets a token
    return sum(m.cpu_experts.op.layer.expert_bytes() * m.num_cpu_experts * is_routed
               for m in llm.model.modules() if isinstance(m, RoutedExperts) and m.has_cpu_part)


def _time_steps(engine: Engine, timer: CpuExpertsTimer) -> tuple[float, list[float]]:
    """Runs the engine dry, the timer counting from zero; (wall seconds, each step's seconds). The spread of the
    steps tells a few slow ones apart from uniformly slow ones."""
    timer.reset()
    counters = engine.llm.counters  # every rank's row (`hybrid.rank_stats`): each rank's own CPU experts
    ranks_before = cpu_seconds_by_rank(counters.table, counters.num_steps)
    start, step_seconds = time.perf_counter(), []
    while engine.has_work():
        step_start = time.perf_counter()
        engine.step()
        step_seconds.append(time.perf_counter() - step_start)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ranks_after = cpu_seconds_by_rank(counters.table, counters.num_steps)
    timer.rank_seconds = tuple(a - b for a, b in zip(ranks_after, ranks_before, strict=True))
    return seconds, step_seconds


def _decode(engine: Engine, prompts: list[list[int]], new_tokens: int, timer: CpuExpertsTimer,
            params: SamplingParams = DECODE_SAMPLING):
    """(wall seconds, each step's seconds, decoded tokens) of the prompts' decode steps."""
    ids = [engine.add_request(p, params, max_tokens=new_tokens, ignore_eos=True) for p in prompts]
    while not all(engine.requests[i].output_ids for i in ids):
        engine.step()  # the prompts (a long context takes several chunks): not part of the decode timing
    # The prompts' step leaves numba's OpenMP threads spinning for up to ~70 ms (`topology.WORKER_SPIN_COUNT`) on
    # the CPUs the decode pool spins on; the steady decode measured here has no prefill step before it.
    time.sleep(0.1)
    seconds, step_seconds = _time_steps(engine, timer)
    finished = [engine.requests.pop(i) for i in ids]
    ended = [len(r.output_ids) for r in finished if r.finish_reason != "length"]
    if ended:  # a grammar that ended: the run is shorter than the one it is compared with
        raise SystemExit(f"hybrid-bench decode: --guided-json's schema ended a request after {ended[0]} tokens, "
                         f"before --tokens: give a schema whose output runs longer")
    return seconds, step_seconds, sum(len(r.output_ids) for r in finished) - len(ids)


def gpu_only_step_seconds(engine: Engine, llm: LLM, prompts, new_tokens: int, timer: CpuExpertsTimer
                          ) -> float | None:
    """The decode step with the CPU experts answering at once (zeros): the GPU's own time plus the hand-off's;
    None off CUDA, and tensor parallel (the zeros would be rank 0's alone: the step would still wait, in the
    all-reduce, for the other ranks' CPU experts)."""
    if not llm.engine_config.is_cuda or llm.tp.size > 1:
        return None
    with cpu_experts_answer_at_once(engine, llm):
        seconds, step_seconds, _ = _decode(engine, prompts, new_tokens, timer)
    return seconds / max(len(step_seconds), 1)


def deferral_kl(llm: LLM, num_tokens: int = 256) -> float | None:
    """Mean KL(exact || deferred) of the next-token distributions over a random prompt's positions: what
    `defer_experts` costs in model semantics (on a synthetic model's random weights, only an indication)."""
    blocks = [m for m in llm.model.modules() if isinstance(m, SparseMoE) and m.is_deferring]
    if not blocks:
        return None
    prompt = torch.randint(llm.config.vocab_size, (min(num_tokens, llm.max_model_len),)).tolist()
    deferred = llm.prefill_logits(prompt).log_softmax(dim=-1)
    for block in blocks:
        block.is_deferring = False
    try:
        exact = llm.prefill_logits(prompt).log_softmax(dim=-1)
    finally:
        for block in blocks:
            block.is_deferring = True
    return float((exact.exp() * (exact - deferred)).sum(dim=-1).mean())


def _measure_decode(engine: Engine, llm: LLM, args, timer: CpuExpertsTimer) -> dict:
    """Decode of `args.batch` prompts of `args.context` tokens: timings, graph replays, the CPU's wait in graph
    steps, the CPU-experts call in the engine and repeated, and the GPU-alone step."""
    vocab = llm.config.vocab_size
    prompts = [torch.randint(vocab, (args.context,)).tolist() for _ in range(args.batch)]
    runner = engine.runner.graphs
    replays = runner.num_replays if runner else 0
    start, swaps = _graph_serving(engine), _num_swaps(llm)
    seconds, step_seconds, tokens = _decode(engine, prompts, args.tokens + 1, timer)
    swaps = _swaps_since(llm, swaps)  # the timed steps' (not the GPU-alone run's)
    rank_cpu = timer.rank_seconds
    waited, pool_s, pool_calls = (now - then for now, then in zip(_graph_serving(engine), start, strict=True))
    cpu, calls = timer.seconds + pool_s, timer.calls + pool_calls
    graph_steps = runner.num_replays - replays if runner is not None else 0
    # In graph steps, the CPU's wait for the GPU to reach each MoE layer: the GPU's work before and between them
    # plus the hand-off, measured on the CPU side of the flags
    cpu_wait_s = waited / graph_steps if runner is not None and runner.worker is not None and graph_steps else None
    # GPU alone before the repeated call: that call's OpenMP threads spin for a while after it (see `_decode`)
    gpu_only_s = gpu_only_step_seconds(engine, llm, prompts, args.tokens + 1, timer)
    hot_s = hot_call_seconds(llm, engine, args.batch)
    return dict(seconds=seconds, step_seconds=step_seconds, cpu=cpu, tokens=tokens, calls=calls, hot_s=hot_s,
                gpu_only_s=gpu_only_s, graph_steps=graph_steps, cpu_wait_s=cpu_wait_s, rank_cpu=rank_cpu,
                swaps=swaps)


def _num_swaps(llm: LLM) -> int | None:
    """Hot experts' swaps so far (None without hot experts)."""
    return llm.hot_experts.num_swaps if llm.hot_experts is not None else None


def _swaps_since(llm: LLM, before: int | None) -> int | None:
    """Hot experts' swaps since `_num_swaps` read `before` (None without hot experts)."""
    return None if before is None else _num_swaps(llm) - before


def measure_guided(engine: Engine, llm: LLM, args, spec: GuidedSpec, timer: CpuExpertsTimer) -> dict:
    """Decode tokens/s without and with `spec` on every request: the same prompts and steps, alternated
    `GUIDED_ROUNDS` times (the host's speed drifts)."""
    prompts = [torch.randint(llm.config.vocab_size, (args.context,)).tolist() for _ in range(args.batch)]
    guided = replace(DECODE_SAMPLING, guided=spec)
    seconds, tokens, steps = {"plain": 0.0, "guided": 0.0}, {"plain": 0, "guided": 0}, {"plain": 0, "guided": 0}
    phases = {kind: dict.fromkeys(HOST_PHASES, 0.0) for kind in seconds}  # the engine's host seconds by phase
    for _ in range(GUIDED_ROUNDS):
        for kind, params in (("plain", DECODE_SAMPLING), ("guided", guided)):
            before = {phase: getattr(engine.host_seconds, phase) for phase in HOST_PHASES}
            run_seconds, step_seconds, run_tokens = _decode(engine, prompts, args.tokens + 1, timer, params)
            seconds[kind] += run_seconds
            tokens[kind] += run_tokens
            steps[kind] += len(step_seconds)
            for phase in HOST_PHASES:
                phases[kind][phase] += getattr(engine.host_seconds, phase) - before[phase]
    plain, constrained = (tokens[k] / seconds[k] for k in ("plain", "guided"))
    host_ms = {kind: {phase: phases[kind][phase] / max(steps[kind], 1) * 1e3 for phase in HOST_PHASES}
               for kind in phases}
    return {"plain_tokens_per_s": plain, "guided_tokens_per_s": constrained, "guided_ratio": constrained / plain,
            "host_ms_per_step": host_ms}


def _graph_serving(engine: Engine) -> tuple[float, float, int]:
    """Totals so far of graph steps' CPU side: seconds waiting for the GPU (worker and pool), and the pool's compute
    seconds and layers (the worker's compute goes through the modules, which `timer` counts)."""
    runner, pool = engine.runner.graphs, decode_pool_of(engine)
    waited = runner.worker.wait_seconds if runner is not None and runner.worker is not None else 0.0
    if pool is None:
        return waited, 0.0, 0
    return waited + pool.wait_seconds, pool.compute_seconds, pool.layers_served


def _read_bandwidth(engine: Engine) -> ReadBandwidth:
    """The bound's read rate, read by the threads that read the experts: the decode pool's pinned ones where it
    serves (parked first, so they do not spin beside the reading ones), else numba's OpenMP team."""
    pool = decode_pool_of(engine)
    if pool is not None:
        pool.park()
    return ReadBandwidth(max(8 * last_level_cache_bytes(), 1 << 30), pool.cpus if pool is not None else None)


def _measure_prefill(engine: Engine, llm: LLM, args, timer: CpuExpertsTimer) -> dict:
    engine.add_request(torch.randint(llm.config.vocab_size, (args.tokens,)).tolist(), max_tokens=1,
                       ignore_eos=True)
    swaps = _num_swaps(llm)
    seconds, step_seconds = _time_steps(engine, timer)
    return dict(seconds=seconds, step_seconds=step_seconds, cpu=timer.seconds, tokens=args.tokens, calls=0,
                hot_s=None, gpu_only_s=None, graph_steps=0, cpu_wait_s=None, rank_cpu=timer.rank_seconds,
                swaps=_swaps_since(llm, swaps))


def streamed_bytes_per_step(llm: LLM, num_tokens: int) -> int | None:
    """Bytes a step of `num_tokens` copies to the GPU (`hybrid.streaming`); None when it is not streamed. A ring
    that holds every unit (a model of NUM_SLOTS units or fewer) copies nothing after the first step."""
    stream = llm.expert_stream
    if stream is None or not stream.units or num_tokens < llm.gpu_prefill_tokens:  # no layer it could stream
        return None
    if len(stream.units) <= stream.num_slots:
        return 0
    return sum(a.nbytes for unit in stream.units for a in unit.arrays().values())


def split_cpu_fraction(llm: LLM) -> float | None:
    """Of the routed CPU-resident experts of the split streamed steps (`hybrid.prefill_split`, warm-up included),
    the fraction the CPU computed; None without such steps (`--prefill-cpu-share 0` or 1, or nothing streamed).
    The bound above counts every expert streamed."""
    counts = [m.streamed.num_split_experts for m in llm.model.modules()
              if isinstance(m, RoutedExperts) and m.streamed is not None]
    total = sum(c[0] + c[1] for c in counts)
    return sum(c[0] for c in counts) / total if total else None


def split_rates(llm: LLM) -> dict | None:
    """The rates `--prefill-cpu-share auto` costs its splits from (`hybrid.prefill_split`, measured at start-up);
    None for a fixed share or nothing streamed."""
    if llm.engine_config.cpu_share is not None:
        return None
    streamed = [m.streamed for m in llm.model.modules() if isinstance(m, RoutedExperts) and m.streamed is not None]
    return asdict(streamed[0].rates) if streamed else None


def _warm_up(engine: Engine, llm: LLM, args, spec: GuidedSpec | None = None) -> None:
    """The measured work once, shortened, so that every kernel it reaches is compiled before the timing: numba
    compiles a kernel on its first call (up to seconds), and a step split unlike the warm-up's (prompts over two
    steps beside decodes, say) reaches kernels a warm-up of other sizes does not (one such step took 1.4 s of a
    batch-8 decode run on the H200 host)."""
    vocab = llm.config.vocab_size
    if args.mode == "prefill":
        engine.generate([torch.randint(vocab, (args.tokens,)).tolist()], max_tokens=3, ignore_eos=True)
        return
    for params in (DECODE_SAMPLING, DECODE_SAMPLING) + ((replace(DECODE_SAMPLING, guided=spec),) if spec else ()):
        engine.generate([torch.randint(vocab, (DECODE_PROMPT_TOKENS,)).tolist() for _ in range(args.batch)],
                        params, max_tokens=3, ignore_eos=True)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def run(args) -> dict:
    torch.manual_seed(0)
    if torch.device(args.device).type == "cuda":  # what LLM does, before the converter starts numba's pool
        use_kernel_threads(len(allowed_cpus()) - 1)
    path = converted_model(args)
    context = args.context if args.mode == "decode" else 0
    config = from_namespace(EngineConfig, args, max_model_len=max(context + args.tokens + 64, 256))
    llm = LLM(path, config=config)
    timer = timed_cpu_experts(llm)
    # a prefill runs in one step unless --max-num-batched-tokens is given (then the runtime's budgets, layer-wise
    # prefill's included, as a server runs); a long decode context in chunks of the budget given (default up to
    # 8192 tokens)
    if args.mode == "prefill":
        chunk = None if args.max_num_batched_tokens else min(llm.max_model_len, max(args.tokens, 64))
    else:
        chunk = min(llm.max_model_len, args.max_num_batched_tokens or max(min(context, LONG_CONTEXT_CHUNK), 64))
    engine = Engine(llm, max_num_batched_tokens=chunk, max_num_seqs=max(args.batch, 1))
    spec = guided_spec(getattr(args, "guided_json", None), args.tokens)
    if spec is not None:
        attach_tokenizer(engine, path, is_synthetic=not args.model)
    _warm_up(engine, llm, args, spec)
    bandwidth = _read_bandwidth(engine)
    read_before = bandwidth()
    m = (_measure_prefill if args.mode == "prefill" else _measure_decode)(engine, llm, args, timer)
    guided = measure_guided(engine, llm, args, spec, timer) if spec is not None else {}
    read_bw = (read_before + bandwidth()) / 2  # the host's rate drifts: passes on both sides of the timing
    is_profiled = args.mode == "decode" and args.profile and config.is_cuda and llm.tp.size == 1
    profile_rows = profile_decode(engine, llm, args, DECODE_SAMPLING) if is_profiled else None
    engine.close()
    kl = deferral_kl(llm)
    llm.close()
    routed_tokens = args.tokens if args.mode == "prefill" else args.batch
    streamed_bytes = streamed_bytes_per_step(llm, routed_tokens)
    link_bw = measure_link(config.device, 256 << 20) if streamed_bytes is not None else None
    steps, step_times = len(m["step_seconds"]), sorted(m["step_seconds"])
    step_s, cpu_s = m["seconds"] / max(steps, 1), m["cpu"] / max(steps, 1)
    gpu_only_s = m["gpu_only_s"]
    rank_cpu_ms = [seconds / max(steps, 1) * 1e3 for seconds in m["rank_cpu"]]
    # Not overlapped with the CPU experts: on CUDA the step's GPU time (measured with the experts answering at
    # once, shared experts included, so the bound is a generous one), on the CPU everything else.
    exposed_s = gpu_only_s if gpu_only_s is not None else step_s - cpu_s
    physical_s = expert_bytes_per_step(llm, routed_tokens) / read_bw  # the experts' reads alone, no GPU time
    bound_s = physical_s + exposed_s
    if streamed_bytes is not None:  # the experts cross the link instead: its time is the floor
        bound_s = physical_s = streamed_bytes / link_bw
    # tensor parallel: the CPU experts' bytes and bandwidth are rank 0's (its slice of I, read by its CPUs)
    return {"mode": args.mode, "model": str(path), "device": config.device, "batch": args.batch, "context": context,
            "tensor_parallel_size": config.tensor_parallel_size,
            "cuda_graph": engine.runner.graphs is not None, "decode_pool": decode_pool_of(engine) is not None,
            "gpu_experts": llm.num_gpu_experts,
            "hot_expert_swaps": m["swaps"],  # in the timed steps
            "tokens_per_s": m["tokens"] / m["seconds"], "step_ms": step_s * 1e3, "steps": steps,
            "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
            "max_prefill_tokens": engine.scheduler.max_prefill_tokens,
            "graph_steps": m["graph_steps"], "step_p50_ms": step_times[len(step_times) // 2] * 1e3,
            "step_max_ms": step_times[-1] * 1e3, "cpu_experts_ms": cpu_s * 1e3, "cpu_wait_ms": _ms(m["cpu_wait_s"]),
            # each rank's own CPU experts per step (rank 0's alone above): the slowest rank sets the step
            "rank_cpu_experts_ms": rank_cpu_ms, "max_rank_cpu_experts_ms": max(rank_cpu_ms),
            "gpu_only_ms": _ms(gpu_only_s), "cpu_call_ms": m["cpu"] / m["calls"] * 1e3 if m["calls"] else None,
            "cpu_call_hot_ms": _ms(m["hot_s"]), "not_cpu_ms": (step_s - cpu_s) * 1e3, "read_gb_s": read_bw / 1e9,
            "bound_ms": bound_s * 1e3, "of_bound": bound_s / step_s, "physical_bound_ms": physical_s * 1e3,
            "of_physical_bound": physical_s / step_s, "defer_experts": config.defer_experts,
            "deferral_kl": kl, "streamed_gb": None if streamed_bytes is None else streamed_bytes / 1e9,
            "link_gb_s": None if link_bw is None else link_bw / 1e9, "profile": profile_rows,
            "prefill_cpu_share": config.prefill_cpu_share, "split_cpu_fraction": split_cpu_fraction(llm),
            "split_rates": split_rates(llm),
            "num_layers": llm.config.num_layers,
            # SMT siblings spin in the decode pool too: whether the host's CPUs are cores or threads of them
            "num_cpus": len(allowed_cpus()), "num_physical_cores": physical_cores(allowed_cpus()), **guided}


def main(argv: list[str], mode: str) -> int:
    parser = argparse.ArgumentParser(prog=f"hybrid-bench {mode}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a hybrid-convert output directory")
    parser.add_argument("--synthetic", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--expert-dtype", default="int8", choices=["int8", "int4", "fp8", "mxfp4", "nvfp4"])
    parser.add_argument("--group-size", type=int, default=None, help="experts' scale group (hybrid-convert's)")
    parser.add_argument("--no-source", action="store_true",
                        help="synthetic: write the converted model directly (random expert codes, one expert file "
                             "every MoE layer loads), for shapes whose bf16 source does not fit beside it")
    parser.add_argument("--skewed-routing", type=int, nargs="?", const=256, default=0, metavar="TOKENS",
                        help="synthetic: Zipf-skewed expert popularity per layer that shifts about every TOKENS "
                             "sampled tokens (default 256; hybrid.synthetic_routing), for --hot-experts-interval")
    parser.add_argument("--batch", type=int, default=1, help="decode: concurrent requests")
    parser.add_argument("--tokens", type=int, default=32 if mode == "decode" else 2048)
    if mode == "decode":
        parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                            help="after the timing, print the GPU time per kernel of STEPS GPU-alone decode steps "
                                 "(torch.profiler; CUDA only)")
        parser.add_argument("--context", type=int, default=DECODE_PROMPT_TOKENS,
                            help="each request's prompt tokens before the timed decode steps (long contexts are "
                                 "prefilled in chunks of --max-num-batched-tokens)")
        parser.add_argument("--guided-json", nargs="?", const="", default=None, metavar="SCHEMA",
                            help="also decode with a JSON schema on every request (a file or JSON text; alone: an "
                                 "array of objects longer than the run), and without, alternated: both rates")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", action="store_true")
    # --expert-dtype is the synthetic conversion's here (the benchmark runs converted models)
    add_arguments(parser, EngineConfig, skip=("max_model_len", "expert_dtype"))
    parser.set_defaults(device="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    args.mode = mode
    row = run(args)
    if args.json:
        print(json.dumps(row))
        return 0
    gpu = "" if row["gpu_only_ms"] is None else f", GPU alone {row['gpu_only_ms']:.2f}"
    rate = f"{row['read_gb_s']:.1f} GB/s read" if row["streamed_gb"] is None else \
        f"{row['streamed_gb']:.2f} GB streamed at {row['link_gb_s']:.1f} GB/s host-to-device"
    context = f", context {args.context}" if mode == "decode" else ""
    tp = f" x {row['tensor_parallel_size']} ranks" if row["tensor_parallel_size"] > 1 else ""
    print(f"{mode} on {row['device']}{tp} ({row['num_cpus']} CPUs on {row['num_physical_cores']} cores), batch "
          f"{row['batch']}{context}, graphs {row['cuda_graph']}, decode pool "
          f"{row['decode_pool']}, GPU experts "
          f"{row['gpu_experts']}: {row['tokens_per_s']:.1f} tokens/s, step {row['step_ms']:.2f} ms (CPU experts "
          f"{row['cpu_experts_ms']:.2f}, rest {row['not_cpu_ms']:.2f}{gpu}); bound {row['bound_ms']:.2f} ms at "
          f"{rate}: {row['of_bound']:.0%} of it; physical bound (the experts' bytes alone) "
          f"{row['physical_bound_ms']:.2f} ms: {row['of_physical_bound']:.0%} of it")
    print(f"{row['steps']} steps ({row['graph_steps']} replayed as graphs; up to {row['max_num_batched_tokens']} "
          f"tokens, {row['max_prefill_tokens']} without decodes): median {row['step_p50_ms']:.2f} ms, slowest "
          f"{row['step_max_ms']:.2f} ms")
    if row["tensor_parallel_size"] > 1:
        print(f"CPU experts per step on each rank: {', '.join(f'{v:.2f}' for v in row['rank_cpu_experts_ms'])} ms "
              f"(slowest {row['max_rank_cpu_experts_ms']:.2f} ms)")
    if row["cpu_wait_ms"] is not None:
        print(f"per graph step, the CPU waited {row['cpu_wait_ms']:.2f} ms for the GPU to reach the MoE layers "
              f"(GPU work before and between them, and the hand-off)")
    if row["cpu_call_ms"] is not None and row["cpu_call_hot_ms"] is not None:
        print(f"CPU experts per call: {row['cpu_call_ms']:.3f} ms in the engine, {row['cpu_call_hot_ms']:.3f} ms "
              f"repeated back to back")
    if row["profile"] is not None:
        print_profile(row["profile"], row["num_layers"])
    if "guided_ratio" in row:
        print(f"JSON schema on every request: {row['guided_tokens_per_s']:.1f} tokens/s against "
              f"{row['plain_tokens_per_s']:.1f} without, {row['guided_ratio']:.3f} of it")
        for kind, phases in row["host_ms_per_step"].items():  # the sample phase holds the wait for the device
            print(f"  engine host ms per step, {kind}: " + ", ".join(f"{p} {v:.3f}" for p, v in phases.items()))
    if row["split_cpu_fraction"] is not None:
        print(f"prefill split ({row['prefill_cpu_share']}): {row['split_cpu_fraction']:.0%} of the routed "
              f"CPU-resident experts computed on the CPU, the rest streamed")
    if row["split_rates"] is not None:
        rates = row["split_rates"]
        print("prefill split rates: CPU " + ", ".join(f"{at} tokens an expert {s * 1e6:.0f} us"
                                                      for at, s in rates["cpu_expert_seconds"])
              + f", {rates['cpu_token_seconds'] * 1e6:.2f} us a token; link {rates['link_bytes_per_s'] / 1e9:.1f} GB/s")
    if row["deferral_kl"] is not None:
        print(f"defer_experts {row['defer_experts']}: KL(exact || deferred) {row['deferral_kl']:.2e} nats/token")
    return 0


def decode_main(argv: list[str]) -> int:
    return main(argv, "decode")


def prefill_main(argv: list[str]) -> int:
    return main(argv, "prefill")
