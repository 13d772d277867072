"""`hybrid-serve`'s own settings (the HTTP side and the engine's batch limits); where and how the model runs is
`hybrid.engine_config.EngineConfig`. The CLI is generated from both (`hybrid.cli_args`)."""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from hybrid.errors import ConfigError
from server import deepseek_v32, harmony
from server.reasoning import REASONING_PARSER_CHOICES
from server.tool_parsers import TOOL_PARSER_CHOICES

DEMO_MODEL_NAME = "hybrid-demo"
HTTP, CHAT = "HTTP and clients", "chat format"  # --help sections
GENERATION_CONFIG_CHOICES = ("auto", "vllm")  # or a directory with a generation_config.json


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = field(default=None, metadata={
        "help": "checkpoint or hybrid-convert directory to serve; none: build and serve the random-weight demo "
                "model (gibberish output, to try the API)"})
    host: str = field(default="127.0.0.1", metadata={
        "help": "address to listen on (0.0.0.0: every interface)", "group": HTTP})
    port: int = field(default=8000, metadata={"help": "port to listen on", "group": HTTP})
    served_model_name: tuple[str, ...] = field(default=(), metadata={
        "help": "the model name(s) clients may send; responses report the first, /v1/models lists them all; "
                "default: the model directory's name", "group": HTTP})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health and "
                "/metrics (also read from HYBRID_API_KEY)", "group": HTTP})
    allowed_origins: tuple[str, ...] = field(default=(), metadata={
        "help": "origins whose browser pages may call the API (CORS: preflight answered, headers added), e.g. "
                "http://localhost:3000, or * for any; default: none", "group": HTTP})
    max_running_requests: int = field(default=64, metadata={
        "help": "requests decoded together (the engine's max_num_seqs)"})
    max_queued_requests: int = field(default=256, metadata={
        "help": "requests waiting beyond the running ones; more are refused with 429"})
    context_length: int | None = field(default=None, metadata={
        "help": "prompt + generated tokens per request (the engine's max_model_len); default min(model limit, 4096)",
        "aliases": ("--max-model-len",)})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "tokens per engine step (prefill chunk budget); default min(512, context length); where routed "
                "experts stream to the GPU, steps without decodes may take more (--layerwise-prefill-tokens)"})
    tool_call_parser: str = field(default="auto", metadata={
        "help": "tool-call format of the model's output; auto: from the chat template and vocabulary (qwen3_coder "
                "also for Qwen3-Next / Qwen3.5 architectures, glm47 for GLM-5's, deepseek_v32 with DeepSeek-V3.2's "
                "encoding); openai: gpt-oss's harmony format (auto for GptOssForCausalLM)",
        "choices": TOOL_PARSER_CHOICES, "group": CHAT})
    reasoning_parser: str = field(default="auto", metadata={
        "help": "return <think>...</think> as reasoning_content; auto: when the vocabulary has the tags (always for "
                "DeepSeek-V3.2 and GLM-5), and for MiniMax-M2 minimax_m2_append_think (the think block stays in "
                "content, as MiniMax recommends); openai_gptoss: gpt-oss's harmony format (auto for GptOssForCausalLM)",
        "choices": REASONING_PARSER_CHOICES, "group": CHAT})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template (a file, or the template text) used instead of the checkpoint's", "group": CHAT})
    # vLLM's --tokenizer-mode deepseek_v32 is the same setting
    chat_format: str = field(default="auto", metadata={
        "help": "how chat messages become the prompt: auto: the chat template, or DeepSeek-V3.2's own encoding for a "
                "DeepseekV32ForCausalLM checkpoint without one; deepseek_v32: that encoding (and its DSML tool calls) "
                "whatever the checkpoint",
        "choices": deepseek_v32.CHAT_FORMAT_CHOICES, "aliases": ("--tokenizer-mode",), "group": CHAT})
    # as vLLM's flag, which turns on tool-call parsing for tool_choice auto: here it always is
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": "accepted for vLLM's command lines: tool calls are always parsed when a request sends tools",
        "group": CHAT})
    generation_config: str = field(default="auto", metadata={
        "help": "default sampling settings of requests that set none: auto: the model directory's "
                "generation_config.json; vllm: none (the API's defaults); or a directory holding one",
        "group": CHAT})
    log_level: str = field(default="info", metadata={
        "help": "server log level", "choices": ("critical", "error", "warning", "info", "debug"), "group": HTTP})
    # as vLLM's flag: for clients that tokenize themselves; the model directory needs no tokenizer files then
    skip_tokenizer_init: bool = field(default=False, metadata={
        "help": "start without the tokenizer: /v1/completions takes token-id prompts only and returns token ids "
                "(empty text); chat and text prompts are refused"})
    # as vLLM's flag: checkpoints whose tokenizer is code shipped beside the weights (Kimi-K2's tiktoken tokenizer,
    # `tokenizer_config.json` auto_map) load only with it, since loading runs that file
    trust_remote_code: bool = field(default=False, metadata={
        "help": "load a tokenizer defined by Python code in the model directory (tokenizer_config.json auto_map, "
                "e.g. Kimi-K2); loading runs that code"})
    stats_log_interval: float = field(default=10.0, metadata={
        "help": "seconds between the throughput / KV-cache usage log lines while requests run (0: off)"})

    def __post_init__(self):
        if self.model is not None:
            _check_model_dir(self.model)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_running_requests < 1:
            raise ConfigError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.max_queued_requests < 0:
            raise ConfigError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        for name in ("context_length", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if isinstance(self.served_model_name, str):  # one name, as the Python API may pass it
            object.__setattr__(self, "served_model_name", (self.served_model_name,))
        if any(not name.strip() for name in self.served_model_name):
            raise ConfigError("--served-model-name must not be empty")
        for origin in self.allowed_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ConfigError(f"--allowed-origins {origin!r}: an origin is * or scheme://host[:port], e.g. "
                                  "http://localhost:3000")
        if self.generation_config not in GENERATION_CONFIG_CHOICES and \
                not (Path(self.generation_config) / "generation_config.json").is_file():
            raise ConfigError(f"--generation-config {self.generation_config}: not auto or vllm, and no "
                              "generation_config.json in that directory")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty; leave it out to serve without a key")
        if self.tool_call_parser not in TOOL_PARSER_CHOICES:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSER_CHOICES)}, "
                              f"got {self.tool_call_parser!r}")
        if not (self.stats_log_interval >= 0 and math.isfinite(self.stats_log_interval)):
            raise ConfigError(f"--stats-log-interval must be a number of seconds >= 0 (0: off), got "
                              f"{self.stats_log_interval}")
        if self.reasoning_parser not in REASONING_PARSER_CHOICES:
            raise ConfigError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSER_CHOICES)}, "
                              f"got {self.reasoning_parser!r}")
        if self.chat_format not in deepseek_v32.CHAT_FORMAT_CHOICES:
            raise ConfigError(f"--chat-format must be one of {', '.join(deepseek_v32.CHAT_FORMAT_CHOICES)}, "
                              f"got {self.chat_format!r}")
        if self.chat_format == deepseek_v32.NAME and (self.tool_call_parser == harmony.TOOL_PARSER_NAME or
                                                      self.reasoning_parser == harmony.REASONING_PARSER_NAME):
            raise ConfigError("--chat-format deepseek_v32 and gpt-oss's harmony format (--tool-call-parser openai, "
                              "--reasoning-parser openai_gptoss) each render the prompt: choose one")

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.model_names[0]

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may send."""
        if self.served_model_name:
            return self.served_model_name
        return (Path(self.model).resolve().name if self.model else DEMO_MODEL_NAME,)

    @property
    def generation_config_dir(self) -> str | None:
        """Where the default sampling settings come from (None: nowhere)."""
        if self.generation_config == "vllm":
            return None
        return self.model if self.generation_config == "auto" else self.generation_config

    def chat_template_text(self) -> str | None:
        """--chat-template's template: the file's text, or the option itself when it is template text."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        if path.is_file():
            try:
                return path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"--chat-template {path}: cannot read it ({exc})") from None
        if "{{" in self.chat_template or "{%" in self.chat_template:
            return self.chat_template
        raise ConfigError(f"--chat-template {self.chat_template}: no such file (and not template text)")

    @property
    def max_in_flight(self) -> int:
        """Engine requests the server holds at once; one more is refused."""
        return self.max_running_requests + self.max_queued_requests


def _check_model_dir(model: str) -> None:
    """The directory exists and this user may list and read it (a directory it cannot reach reads as missing to
    `Path.is_dir`, which would blame the wrong thing)."""
    try:
        is_dir = stat.S_ISDIR(os.stat(model).st_mode)
    except PermissionError:
        is_dir = None
    except OSError:
        is_dir = False
    if is_dir is False:
        raise ConfigError(f"--model {model}: no such directory; pass a checkpoint directory or leave --model out to "
                          f"serve the demo model")
    if is_dir is None or not os.access(model, os.R_OK | os.X_OK):
        raise ConfigError(f"--model {model}: permission denied: this user (uid {os.geteuid()}) cannot read the "
                          f"directory; make it and its parents readable (chmod a+rX) or run as its owner")
