"""The OpenAI request bodies the server accepts, as pydantic models: types and ranges are checked here, so a
handler only sees valid requests. Fields clients commonly send that change nothing here (`user`, `metadata`,
`store`, `parallel_tool_calls`, ...) are accepted and ignored; fields whose meaning the server cannot honour
(`suffix`, `best_of` != n) are rejected by name. Structured outputs (`response_format`, vLLM's `guided_*`) are
checked for shape here and compiled by `server.structured`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NonNegInt = Annotated[int, Field(ge=0)]
MAX_N = 128  # completions per request; the queue limit bounds the total anyway
MAX_TOP_LOGPROBS = 20
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # Clients send null for what they leave unset (`"n": null`, `"presence_penalty": null`): the default.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str = Field(min_length=1)


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = ""


class MessageToolCall(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content part of type '{part.type}' is not supported: only text parts")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class SamplingRequest(OpenAIModel):
    """The fields chat and completions share."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # 0 and -1: all tokens
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, ge=1)
    logit_bias: dict[str, float] | None = None
    # extensions in the style of vLLM's
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _one_guide(self):
        named = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None]
        if len(named) > 1:
            raise ValueError(f"at most one of {', '.join(named)} may be set")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, value):
        for key in value or {}:
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids (strings of digits), got {key!r}")
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """(token id, bias) pairs, in the engine's form."""
        return tuple((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items())

    @property
    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in stop if s)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # gpt-oss (harmony): the system message's `Reasoning:`; other models' templates get it as a variable
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.response_format and self.response_format.get("type", "text") not in RESPONSE_FORMATS:
            raise ValueError(f"response_format type '{self.response_format.get('type')}' is not supported: one of "
                             f"{', '.join(RESPONSE_FORMATS)}")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            names = {tool.function.name for tool in self.tools or ()}
            if not names:
                raise ValueError("tool_choice needs tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names function '{self.tool_choice.function.name}', not in tools")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """The engine's logprobs setting: None, or how many top tokens (0: the sampled token's only)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[NonNegInt] | list[list[NonNegInt]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions

    @model_validator(mode="after")
    def _check(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (no prompt logprobs)")
        prompts = [self.prompt] if isinstance(self.prompt, str) or _is_ids(self.prompt) else self.prompt
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompt is empty")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or _is_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
