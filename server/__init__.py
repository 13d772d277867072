"""server: `hybrid-serve`, an OpenAI-compatible HTTP front end. Depends on `hybrid`, never the other way round.

Data flow of one request:

1. `app` (FastAPI, built by `build_app(config, engine_loop)`, no globals): auth, pydantic validation
   (`protocol`), errors as OpenAI JSON (`errors`), per-app Prometheus registry (`metrics`);
2. `chat` / `completions`: chat template (`tokenizer_config.json`; gpt-oss: `harmony`, DeepSeek-V3.2:
   `deepseek_v32`) -> token ids, sampling parameters, the context check; a `serving.Generation` submits one
   `engine_loop.GenerateJob` per choice;
3. `engine_loop.EngineLoop`: the one thread that owns `hybrid.engine.Engine`; commands (add, cancel) arrive on a
   queue, it steps while there is work, detokenizes (`hybrid.detokenizer`) and checks stop strings, and hands
   `Output` events back to asyncio with `loop.call_soon_threadsafe`;
4. back in the handler: `reasoning` (`<think>` -> reasoning_content) and `tool_parsers` (-> tool_calls) split the
   text; SSE chunks or one JSON response go out. Every engine request ends in a finish or a cancel (a client that
   disconnects cancels its requests).

`cli` generates its options from `config.ServerConfig` and `hybrid.engine_config.EngineConfig` and runs the
start-up steps of `startup` (checks, the socket bound before the model loads, timed phases, the warm-up request);
`demo` builds the random-weight demo model; `loadtest` measures a running server on the loopback interface.
"""
