"""`hybrid-serve`'s own settings (the HTTP side and the engine's batch limits); where and how the model runs is
`hybrid.engine_config.EngineConfig`. The CLI is generated from both (`hybrid.cli_args`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hybrid.errors import ConfigError
from server.tool_parsers import TOOL_PARSER_CHOICES

# qwen3 and deepseek_r1 read the same <think> tags (DeepSeek-R1 templates open the block in the prompt)
REASONING_PARSER_CHOICES = ("auto", "none", "qwen3", "deepseek_r1")
DEMO_MODEL_NAME = "hybrid-demo"


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = field(default=None, metadata={
        "help": "checkpoint or hybrid-convert directory to serve; none: build and serve the random-weight demo "
                "model (gibberish output, to try the API)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on (0.0.0.0: every interface)"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the model name clients send and /v1/models lists; default: the model directory's name"})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' on every /v1 route (also read from HYBRID_API_KEY)"})
    max_running_requests: int = field(default=64, metadata={
        "help": "requests decoded together (the engine's max_num_seqs)"})
    max_queued_requests: int = field(default=256, metadata={
        "help": "requests waiting beyond the running ones; more are refused with 429"})
    context_length: int | None = field(default=None, metadata={
        "help": "prompt + generated tokens per request (the engine's max_model_len); default min(model limit, 4096)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "tokens per engine step (prefill chunk budget); default min(512, context length)"})
    tool_call_parser: str = field(default="auto", metadata={
        "help": "tool-call format of the model's output; auto: from the chat template and vocabulary",
        "choices": TOOL_PARSER_CHOICES})
    reasoning_parser: str = field(default="auto", metadata={
        "help": "return <think>...</think> as reasoning_content; auto: when the vocabulary has the tags",
        "choices": REASONING_PARSER_CHOICES})
    log_level: str = field(default="info", metadata={
        "help": "server log level", "choices": ("critical", "error", "warning", "info", "debug")})

    def __post_init__(self):
        if self.model is not None and not Path(self.model).is_dir():
            raise ConfigError(f"--model {self.model}: no such directory; pass a checkpoint directory or leave "
                              f"--model out to serve the demo model")
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
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("--served-model-name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty; leave it out to serve without a key")
        if self.tool_call_parser not in TOOL_PARSER_CHOICES:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSER_CHOICES)}, "
                              f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSER_CHOICES:
            raise ConfigError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSER_CHOICES)}, "
                              f"got {self.reasoning_parser!r}")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).resolve().name if self.model else DEMO_MODEL_NAME

    @property
    def max_in_flight(self) -> int:
        """Engine requests the server holds at once; one more is refused."""
        return self.max_running_requests + self.max_queued_requests
