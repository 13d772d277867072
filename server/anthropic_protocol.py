"""The Anthropic Messages API's request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`) as pydantic
models, and their conversion to the chat pipeline's `ChatCompletionRequest`, so that one path renders the prompt
and parses the output for both APIs: the system prompt becomes the system message, text blocks the message's text,
an assistant's `tool_use` blocks its tool_calls, a user's `tool_result` blocks tool messages (before the user's own
text), `thinking` blocks the assistant's reasoning_content; `tools` become functions, `tool_choice` any / tool /
none become required / a named function / none. Content the server cannot read (images, documents, server
tools) is refused by name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from server.errors import APIError
from server.protocol import ChatCompletionRequest, OpenAIModel


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIModel):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(OpenAIModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)


class ThinkingBlock(OpenAIModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(OpenAIModel):
    """Opaque to this server (Anthropic's encrypted reasoning): accepted so that clients may send a whole
    assistant turn back, and left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


class InputMessage(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(OpenAIModel):
    type: Literal["custom"] | None = None  # Anthropic's server tools (web_search, bash, ...) are not run here
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False  # nothing constrains decoding: the model may write several calls


class ThinkingConfig(OpenAIModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)  # no thinking budget is enforced; max_tokens is

    @property
    def is_enabled(self) -> bool:
        return self.type != "disabled"


class CountTokensRequest(OpenAIModel):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="after")
    def _check_tool_choice(self):
        choice = self.tool_choice
        if choice is None or choice.type in ("auto", "none"):
            return self
        names = {tool.name for tool in self.tools or ()}
        if not names:
            raise ValueError(f"tool_choice '{choice.type}' needs tools")
        if choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names tool '{choice.name}', which is not in tools")
        return self

    @property
    def shows_thinking(self) -> bool:
        """Whether the model's reasoning comes back as thinking blocks: unless the request disabled thinking (a
        request that says nothing gets it, as vLLM's Anthropic endpoint returns it)."""
        return self.thinking is None or self.thinking.is_enabled


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None


def to_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that renders the same prompt and samples as `body` asks."""
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                             "parameters": tool.input_schema}} for tool in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    if body.thinking is not None:
        # The templates' switches: Qwen3 and GLM read enable_thinking, Kimi-K2.5 and DeepSeek-V3.1 thinking.
        is_enabled = body.thinking.is_enabled
        fields["chat_template_kwargs"] = {"enable_thinking": is_enabled, "thinking": is_enabled}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:  # the checks above should leave none; still a 400, not a 500
        first = exc.errors()[0]
        raise APIError(400, str(first.get("msg", "invalid request")).removeprefix("Value error, ")) from None


def _tool_choice(choice: ToolChoice):
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_messages(body: CountTokensRequest) -> list[dict]:
    system = body.system if isinstance(body.system, str) else "".join(block.text for block in body.system or ())
    messages = [{"role": "system", "content": system}] if system else []
    for message in body.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            messages.extend(_user_messages(message.content))
        else:
            messages.append(_assistant_message(message.content))
    return messages


def _user_messages(blocks: list) -> list[dict]:
    """A user turn's tool results as tool messages (they answer the calls of the turn before), then its text."""
    messages = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
                for block in blocks if block.type == "tool_result"]
    text = "".join(block.text for block in blocks if block.type == "text")
    if text or not messages:
        messages.append({"role": "user", "content": text})
    return messages


def _assistant_message(blocks: list) -> dict:
    message: dict = {"role": "assistant", "content": "".join(block.text for block in blocks if block.type == "text")}
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
             for block in blocks if block.type == "tool_use"]
    if calls:
        message["tool_calls"] = calls
    reasoning = "".join(block.thinking for block in blocks if block.type == "thinking")
    if reasoning:
        message["reasoning_content"] = reasoning
    return message
