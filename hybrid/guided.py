"""Grammar-constrained decoding with xgrammar: compiled grammars cached by spec, one matcher per constrained
request, and the step's token bitmask filled on the host.

The engine fills the bitmask (`GuidedRequests.fill`) after the runner has launched the step's forward pass and
before sampling reads its logits, so on a GPU the host computes the masks while the device computes the logits;
`hybrid.sampling.sample_batch` then applies them on the device: one page-locked buffer, one copy queued without
waiting, three device ops over every row at once, no wait for the device but the sampler's own. The mask applies to
the logits a CUDA graph returns, outside the graph, so the captured graphs are the same with or without constraints.
A request without a spec has no matcher, and a step without one no mask: it pays nothing, and xgrammar is not even
imported until a first spec is compiled. What a constrained step still adds after its wait for the device: each
constrained row's `accept` (xgrammar advancing its matcher by the sampled token) and the mask's device ops.

A matcher advances with each token the request samples and with nothing else. A preempted request keeps its output
tokens and recomputes their KV; the token sampled after the recompute follows them, so its matcher stays as it was
(no rollback). The matcher's stop tokens are the request's: EOS is allowed only where the grammar may end, and a
request whose grammar has ended finishes with "stop".
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from hybrid.sampling import GuidedSpec, TokenMask

if TYPE_CHECKING:
    import xgrammar

MAX_CACHED_GRAMMARS = 256
# xgrammar's JSON string characters (as it prints them): a length-bounded string's take raw control characters,
# which JSON forbids (`json.loads` refuses them), and both take UTF-16 surrogates (U+D800-DFFF), which UTF-8 forbids
# (decoding makes each byte a U+FFFD): the characters JSON and UTF-8 allow instead
SURROGATES = r"\uD800-\uDFFF"
STRING_CHARACTERS = {r'[^\"\\\r\n]': r'[^\0-\x1f\"\\' + SURROGATES + "]",
                     r'[^\0-\x1f\"\\\r\n]': r'[^\0-\x1f\"\\' + SURROGATES + "]"}
NEEDS_TOKENIZER = "guided decoding needs a tokenizer: build the engine with Engine(llm, tokenizer=...)"


class GrammarCache:
    """Compiled grammars by (kind, spec), the least recently used dropped past `max_entries`. Thread-safe: the
    server compiles in its prompt threads (an invalid spec is a 400 there), the engine thread then finds the entry.
    xgrammar's own compiler cache is off: it would grow without bound."""

    def __init__(self, vocab_size: int, tokenizer=None, max_entries: int = MAX_CACHED_GRAMMARS):
        """`vocab_size`: the logits' width (config.vocab_size), which may exceed the tokenizer's size."""
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._tokenizer = tokenizer
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._entries: OrderedDict[GuidedSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    def attach_tokenizer(self, tokenizer) -> None:
        """The tokenizer grammars compile against, where the engine was built without one (the server's)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = tokenizer

    def get(self, spec: GuidedSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec`; ValueError naming what is wrong with an invalid one."""
        with self._lock:
            compiled = self._entries.get(spec)
            if compiled is not None:
                self._entries.move_to_end(spec)
                return compiled
            compiler = self._get_compiler()
        compiled = _compile(compiler, spec)  # outside the lock: a large schema takes a while
        with self._lock:
            self._entries[spec] = compiled
            self._entries.move_to_end(spec)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._entries)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            if self._tokenizer is None:
                raise ValueError(NEEDS_TOKENIZER)
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


def _compile(compiler: xgrammar.GrammarCompiler, spec: GuidedSpec) -> xgrammar.CompiledGrammar:
    try:
        if spec.kind == "json_object":  # any object, without the builtin grammar's unbounded whitespace
            return compiler.compile_grammar(json_schema_grammar('{"type": "object"}'))
        if spec.kind == "json_schema":
            return compiler.compile_grammar(json_schema_grammar(spec.spec))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.spec)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(spec.spec)))
        return _compile_structural_tag(compiler, json.loads(spec.spec))
    except ValueError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (and its own errors) for invalid specs
        raise ValueError(f"invalid {spec.kind}: {error_reason(exc)}") from None


def error_reason(exc: Exception) -> str:
    """xgrammar's message without its timestamp, C++ source location and failed-check preamble."""
    text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text.strip().splitlines()[0] if text.strip() else repr(exc))
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)


def json_schema_grammar(schema: str) -> str:
    """The EBNF grammar of compact JSON valid against `schema` (JSON text): no optional whitespace, which a model
    could otherwise pad its output with up to max_tokens; its strings' characters those JSON and UTF-8 allow
    (`STRING_CHARACTERS`)."""
    import xgrammar

    try:
        grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    except Exception as exc:  # xgrammar raises RuntimeError (and its own errors) for invalid schemas
        raise ValueError(f"invalid json_schema: {error_reason(exc)}") from None
    text = str(grammar)
    for lenient, strict in STRING_CHARACTERS.items():
        text = text.replace(lenient, strict)
    return text


def choice_grammar(choices: list) -> str:
    """An EBNF grammar of exactly one of `choices` (strings)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("guided_choice must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _compile_structural_tag(compiler: xgrammar.GrammarCompiler, tag: dict) -> xgrammar.CompiledGrammar:
    """xgrammar's structural tag ({"type": "structural_tag", "format": ...}), or the older form vLLM also takes
    ({"structures": [{"begin", "schema", "end"}], "triggers": [...]})."""
    if "format" in tag:
        return compiler.compile_structural_tag(tag)
    import xgrammar

    items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
             for s in tag.get("structures", ())]
    return compiler.compile_structural_tag(items, list(tag.get("triggers", ())))


class GuidedRequests:
    """The engine's matchers, one per constrained request (by request id), and the host buffer their masks are
    filled in."""

    def __init__(self, grammars: GrammarCache, pin_memory: bool = False):
        """`pin_memory`: the logits are on CUDA; the masks are filled in page-locked memory, whose copy to the device
        is queued without waiting (from pageable memory the driver may wait for the step before copying)."""
        self.grammars = grammars
        self.pin_memory = pin_memory
        self._matchers: dict[int, xgrammar.GrammarMatcher] = {}
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, reused by every step

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._matchers

    def add(self, request_id: int, spec: GuidedSpec, stop_token_ids: frozenset[int]) -> None:
        import xgrammar

        compiled = self.grammars.get(spec)
        if stop_token_ids:
            matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids))
        else:  # ignore_eos and no stop ids: the request ends where the grammar does
            matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        self._matchers[request_id] = matcher

    def remove(self, request_id: int) -> None:
        self._matchers.pop(request_id, None)

    def fill(self, request_ids: list[int]) -> TokenMask | None:
        """The step's mask, one row per sampled row (`request_ids`: the rows' requests, in order), an unconstrained
        row's all ones; None when no row is constrained (nothing is done). Filled in one buffer that every step
        reuses: the step's sampling ends in a transfer that waits for the device (`sample_batch`), after the mask's
        copy, so the next step finds the buffer free."""
        if not self._matchers:  # no constrained request at all: not even a look at the rows
            return None
        rows = [i for i, request_id in enumerate(request_ids) if request_id in self._matchers]
        if not rows:
            return None
        bitmask = self._rows(len(request_ids))
        if len(rows) < len(request_ids):
            bitmask.fill_(-1)  # every token allowed; the constrained rows are overwritten whole
        matchers = [self._matchers[request_ids[i]] for i in rows]
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            if self._batch is None:
                import xgrammar

                # one thread, the engine's: while a CUDA step runs, the host's other cores compute its CPU experts
                self._batch = xgrammar.BatchGrammarMatcher(max_threads=1)
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return TokenMask(bitmask)

    def _rows(self, num_rows: int) -> torch.Tensor:
        """The first `num_rows` rows of the mask buffer, allocated (page-locked if `pin_memory`) at the first step
        that needs more, twice the rows it had: a server's batch grows a request at a time."""
        if self._bitmask is None or len(self._bitmask) < num_rows:
            capacity = max(num_rows, 2 * len(self._bitmask)) if self._bitmask is not None else num_rows
            self._bitmask = torch.empty(capacity, (self.grammars.vocab_size + 31) // 32, dtype=torch.int32,
                                        pin_memory=self.pin_memory)
        return self._bitmask[:num_rows]

    def accept(self, request_id: int, token: int) -> tuple[bool, bool]:
        """Advances the request's matcher by its sampled token: (accepted, the grammar has ended). An unconstrained
        request: (True, False)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True, False
        if not matcher.accept_token(token):
            return False, False
        return True, matcher.is_terminated()

