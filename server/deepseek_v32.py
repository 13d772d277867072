"""DeepSeek-V3.2's chat encoding: the checkpoint ships no Jinja chat template but a Python script
(`encoding/encoding_dsv32.py`) that writes the prompt, and this module writes the same text (vLLM: `--tokenizer-mode
deepseek_v32`). Its tool calls are "DSML" blocks, parsed by `server.dsml`.

The prompt: `<｜begin▁of▁sentence｜>`, the system messages as they are (the first one followed by the tools prompt,
"## Tools ... <functions>{one JSON schema a line}</functions>", when the request has tools; without a system
message the tools prompt comes first, after a blank line, as vLLM writes it), then per turn
`<｜User｜>TEXT<｜Assistant｜>` and the think token: `<think>` after the last user message in thinking mode (the
model's output starts inside the think block), `</think>` otherwise. An assistant message is `REASONING</think>`
(thinking mode, and only after the last user message: the reasoning of earlier turns is dropped), its text, its
calls (`\\n\\n<｜DSML｜function_calls>...`), then `<｜end▁of▁sentence｜>`. A run of tool messages is one
`\\n\\n<function_results>\\n<result>...</result>...\\n</function_results>` block followed by `\\n\\n` and the think
token, as after a user message.

Thinking mode is off unless the request's `chat_template_kwargs` set `thinking` or `enable_thinking` true (vLLM's
reading of the same kwargs). OpenAI's "developer" role is a system message here, as for the other formats (the
script's own developer role is a user turn of its search agent).
"""

from __future__ import annotations

import json

from server.errors import APIError
from server.reasoning import THINK_END, THINK_START

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
DSML = "｜DSML｜"
CALLS_START, CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
INVOKE_START, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAMETER_START, PARAMETER_END = f"<{DSML}parameter", f"</{DSML}parameter>"
RESULTS_START, RESULTS_END = "<function_results>", "</function_results>"
ARCHITECTURE = "DeepseekV32ForCausalLM"
NAME = "deepseek_v32"
CHAT_FORMAT_CHOICES = ("auto", NAME)
THINKING_KWARGS = ("thinking", "enable_thinking")

TOOLS_PROMPT = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "{CALLS_START}" block like the following as part of your reply to the user:
{CALLS_START}
{INVOKE_START} name="$FUNCTION_NAME">
{PARAMETER_START} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_END}
...
{INVOKE_END}
{INVOKE_START} name="$FUNCTION_NAME2">
...
{INVOKE_END}
{CALLS_END}
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects \
should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for \
other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking \
block. Here is an example:
{CALLS_START}
...
{CALLS_END}
{RESULTS_START}
...
{RESULTS_END}
{THINK_START}...thinking about results{THINK_END}
Here are the functions available in JSONSchema format:
<functions>
{{schemas}}
</functions>
"""


def is_selected(choice: str, chat_template: str, architectures) -> bool:
    """Whether chat prompts use this encoding: `--chat-format deepseek_v32`, or `auto` and a DeepSeek-V3.2
    checkpoint without a chat template (V3.2-Exp, the same architecture, ships a Jinja template in V3.1's format)."""
    return choice == NAME or (choice == "auto" and not chat_template and ARCHITECTURE in (architectures or ()))


def is_thinking(chat_template_kwargs: dict | None) -> bool:
    return any(bool((chat_template_kwargs or {}).get(key)) for key in THINKING_KWARGS)


def tools_prompt(tools: list[dict]) -> str:
    schemas = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return TOOLS_PROMPT.replace("{schemas}", schemas)


def render_prompt(messages, tools: list[dict] | None, chat_template_kwargs: dict | None) -> str:
    """The prompt of a chat request (`server.protocol.ChatMessage`s; `tools`: OpenAI tool dicts, None when the
    tool choice leaves them out). It ends where the model's turn starts, so the last message must be a user or
    tool message."""
    roles = ["system" if m.role == "developer" else m.role for m in messages]
    if roles[-1] not in ("user", "tool"):
        raise APIError(400, f"messages.{len(roles) - 1}: DeepSeek-V3.2's encoding starts the assistant's turn after "
                            f"a user or tool message, and the last message is a {messages[-1].role} message; end "
                            f"the conversation with a user or tool message", param="messages")
    thinking = is_thinking(chat_template_kwargs)
    last_user = max((i for i, role in enumerate(roles) if role == "user"), default=-1)
    parts = [BOS]
    if tools and roles[0] != "system":
        parts.append("\n\n" + tools_prompt(tools))
    for index, (role, message) in enumerate(zip(roles, messages, strict=True)):
        think = THINK_START if thinking and index >= last_user else THINK_END  # where the next turn starts
        if role == "system":
            parts.append(message.text() + ("\n\n" + tools_prompt(tools) if tools and index == 0 else ""))
        elif role == "user":
            parts.append(USER + message.text() + ASSISTANT + think)
        elif role == "assistant":
            reasoning = (message.reasoning_content or "") + THINK_END if thinking and index > last_user else ""
            parts.append(reasoning + message.text() + _calls_text(message.tool_calls, index) + EOS)
        else:  # a run of tool messages is one results block
            is_first = index == 0 or roles[index - 1] != "tool"
            is_last = index + 1 == len(roles) or roles[index + 1] != "tool"
            parts.append(("\n\n" + RESULTS_START if is_first else "") + f"\n<result>{message.text()}</result>"
                         + ("\n" + RESULTS_END + "\n\n" + think if is_last else ""))
    return "".join(parts)


def _calls_text(tool_calls, message_index: int) -> str:
    if not tool_calls:
        return ""
    invokes = []
    for index, call in enumerate(tool_calls):
        arguments = _arguments(call.function.arguments, f"messages.{message_index}.tool_calls.{index}.function"
                                                         f".arguments")
        parameters = "\n".join(
            f'{PARAMETER_START} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f'{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}{PARAMETER_END}'
            for key, value in arguments.items())
        invokes.append(f'{INVOKE_START} name="{call.function.name}">\n{parameters}\n{INVOKE_END}')
    return "\n\n" + CALLS_START + "\n" + "\n".join(invokes) + "\n" + CALLS_END


def _arguments(arguments, param: str) -> dict:
    """A call's arguments as an object (the encoding writes each one), from the JSON text OpenAI clients send."""
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{param}: DeepSeek-V3.2's encoding writes each argument of a call, so the arguments "
                            f"must be a JSON object (text of one, as the call was returned)", param=param)
    return arguments
