"""`hybrid-bench decode --guided-json`'s inputs: the JSON schema every constrained request decodes under and the
tokenizer its grammar compiles against (a synthetic model gets one of its vocabulary's size)."""

from __future__ import annotations

import json
from pathlib import Path

from hybrid.engine import Engine
from hybrid.sampling import GuidedSpec
from hybrid.synthetic_tokenizer import write_synthetic_tokenizer

# --guided-json's default: objects of a directory listing, more of them than a run can write (an object is tens of
# tokens), so that every constrained request runs its --tokens steps
GUIDED_ITEM = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["file", "directory", "link"]}, "size": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "hidden": {"type": "boolean"}}, "required": ["id", "name", "kind", "size", "tags", "hidden"],
    "additionalProperties": False}


def guided_spec(text: str | None, num_tokens: int) -> GuidedSpec | None:
    """--guided-json's schema (a file or JSON text; "": the default, long enough for `num_tokens`)."""
    if text is None:
        return None
    if not text:
        return GuidedSpec("json_schema", json.dumps({"type": "array", "minItems": num_tokens + 1,
                                                     "items": GUIDED_ITEM}))
    if not text.lstrip().startswith(("{", "true", "false")):
        text = Path(text).read_text()
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"hybrid-bench decode: --guided-json is not a JSON schema file or text: {exc}") from None
    return GuidedSpec("json_schema", text)


def attach_tokenizer(engine: Engine, path: Path, is_synthetic: bool) -> None:
    """The grammars' tokenizer: the model's, or for a synthetic model one of its vocabulary's size, saved beside
    it. Attached to the grammars alone: an engine with a tokenizer would detokenize every output, a cost the
    comparison is not about."""
    from transformers import AutoTokenizer

    if is_synthetic:
        write_synthetic_tokenizer(path, engine.llm.config.vocab_size)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"hybrid-bench decode: --guided-json needs the model's tokenizer in {path}: {exc}") from None
    engine.grammars.attach_tokenizer(tokenizer)
