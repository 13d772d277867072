"""`hybrid-serve [--model DIR] [options]`: an OpenAI-compatible server over one model.

The options are generated from `ServerConfig` (HTTP side, batch limits) and `EngineConfig` (where and how the model
runs; `--context-length` is its max_model_len). Without `--model` it builds (once, cached) and serves the demo
model, whose weights are random. Every start-up failure is one line on stderr and exit code 1 (the traceback of an
unforeseen one only with --log-level debug). The start-up steps themselves are `server.startup`'s.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace

import torch

from hybrid.cli_args import add_arguments, from_namespace
from hybrid.engine_config import EngineConfig
from hybrid.errors import ConfigError, HybridError
from server.config import DEMO_MODEL_NAME, ServerConfig

log = logging.getLogger("hybrid.server")
SHUTDOWN_GRACE_SECONDS = 5
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(message)s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-serve", description="OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
                                         "/v1/models, /tokenize, /detokenize, /version, /health, /metrics) over one "
                                         "MoE model. vLLM's names of the common options are accepted too "
                                         "(--max-model-len, --served-model-name, --chat-template, ...).")
    add_arguments(parser, ServerConfig, title="model and requests")
    add_arguments(parser, EngineConfig, skip=("max_model_len", "max_num_seqs", "max_num_batched_tokens"),
                  title="engine (where and how the model runs)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        config = from_namespace(ServerConfig, args, api_key=args.api_key or os.environ.get("HYBRID_API_KEY"))
        engine_config = from_namespace(EngineConfig, args, max_model_len=args.context_length,
                                       max_num_seqs=args.max_running_requests,
                                       max_num_batched_tokens=args.max_num_batched_tokens)
        return serve(config, engine_config)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # whatever stops the start, the user gets one line
        print(f"hybrid-serve: error: {_one_line(exc)}", file=sys.stderr)
        return 1


def _one_line(exc: Exception) -> str:
    if isinstance(exc, HybridError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:  # an unreadable or missing file of the model
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return (f"out of memory while starting ({detail}); lower --kv-cache-tokens or --context-length, or use a "
                f"machine with more memory")
    log.debug("start-up failed", exc_info=True)
    return f"{type(exc).__name__}: {exc} (run with --log-level debug for where it happened)"


def serve(config: ServerConfig, engine_config: EngineConfig) -> int:
    from hybrid.llm import LLM
    from server.app import build_app, load_tokenizer
    from server.engine_loop import EngineLoop
    from server.startup import bind_socket, check_device, check_engine_files, run_uvicorn, timed, url_of

    check_device(engine_config)
    check_engine_files(engine_config)
    sock = bind_socket(config.host, config.port)  # before the model loads: a port in use fails now
    llm = engine = None
    try:
        config = _resolve_model(config)
        tokenizer = None
        if not config.skip_tokenizer_init:
            with timed("loading the tokenizer"):
                tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        with timed(f"loading the model from {config.model} (weights, KV cache)"):
            llm = LLM(config.model, config=engine_config)
        engine = _start_engine(config, llm)
        loop = EngineLoop(engine, tokenizer, llm.max_model_len, config.stats_log_interval)
        app = build_app(config, loop)
        ready = (f"hybrid-serve: ready: serving '{config.model_name}' (context length {llm.max_model_len}) at "
                 f"{url_of(sock)}")
        # requests still running near the end of the grace period are ended with 503 (`server.serving.drain`)
        run_uvicorn(app, sock, config.log_level, SHUTDOWN_GRACE_SECONDS, ready)
    finally:  # the app stopped the engine loop at shutdown: nothing runs the engine any more
        sock.close()
        if engine is not None:
            engine.close()
        if llm is not None:
            llm.close()
            log.info("hybrid-serve: stopped")
    return 0


def _resolve_model(config: ServerConfig) -> ServerConfig:
    """`config` with its model directory: the demo model's (built on the first start) when no --model is given."""
    if config.model is not None:
        return config
    from server.demo import demo_cache_dir, describe
    from server.startup import demo_model_dir, timed

    log.info("no --model: serving the demo model (RANDOM weights, gibberish output; it is there to try the "
             "API), cached in %s", demo_cache_dir())
    with timed("preparing the demo model (built on the first start only)"):
        path = demo_model_dir()
    log.info("%s", describe(path))
    return replace(config, model=str(path), served_model_name=config.served_model_name or DEMO_MODEL_NAME)


def _start_engine(config: ServerConfig, llm):
    """The engine over `llm` (CUDA graphs captured), warmed up by one request."""
    from hybrid.engine import Engine
    from server.startup import timed, warm_up

    graphs = "capturing CUDA graphs" if llm.engine_config.cuda_graph and llm.engine_config.is_cuda else "no graphs"
    with timed(f"starting the engine ({graphs})"):
        try:
            # the step budget is the LLM's (--max-num-batched-tokens, or layer-wise prefill's where experts stream)
            engine = Engine(llm, max_num_seqs=config.max_running_requests)
        except ValueError as exc:  # limits that do not fit the context length
            raise ConfigError(str(exc)) from None
    with timed("warm-up request"):
        warm_up(engine, llm.config.vocab_size, llm.max_model_len)
    return engine


if __name__ == "__main__":
    sys.exit(main())
