"""Structured outputs: a request's grammar (`hybrid.sampling.GuidedSpec`) from OpenAI's `response_format`
(json_object, json_schema, structural_tag), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, or a forced tool call, compiled in the prompt threads so that an invalid one is a 400 naming its
field (the engine finds it in its grammar cache). A forced tool call's grammar is `server.tool_grammars`'.
"""

from __future__ import annotations

import json

from hybrid.sampling import GuidedSpec
from server.errors import APIError

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def request_spec(request) -> tuple[GuidedSpec | None, str | None]:
    """The request's own grammar and the field it came from ((None, None): unconstrained)."""
    if request.guided_json is not None:
        schema = request.guided_json
        return GuidedSpec("json_schema", schema if isinstance(schema, str) else json.dumps(schema)), "guided_json"
    if request.guided_regex is not None:
        return GuidedSpec("regex", request.guided_regex), "guided_regex"
    if request.guided_choice is not None:
        return GuidedSpec("choice", json.dumps(request.guided_choice)), "guided_choice"
    if request.guided_grammar is not None:
        return GuidedSpec("grammar", request.guided_grammar), "guided_grammar"
    return _response_format_spec(getattr(request, "response_format", None))


def _response_format_spec(response_format: dict | None) -> tuple[GuidedSpec | None, str | None]:
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return GuidedSpec("json_object"), "response_format"
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict | bool):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                           param="response_format.json_schema.schema")
        return GuidedSpec("json_schema", json.dumps(schema)), "response_format.json_schema.schema"
    return GuidedSpec("structural_tag", json.dumps(response_format)), "response_format"


def compile_spec(state, spec: GuidedSpec | None, param: str | None) -> None:
    """Compiles `spec` into the engine's grammar cache (run `off_loop`): an invalid one is a 400 naming `param`."""
    if spec is None:
        return
    grammars = getattr(state.loop.engine, "grammars", None)
    if grammars is None or state.model.tokenizer is None:
        raise APIError(400, "structured outputs need the tokenizer and an engine with grammars", param=param)
    grammars.attach_tokenizer(state.model.tokenizer)
    try:
        grammars.get(spec)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
