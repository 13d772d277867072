"""Incremental detokenization with stop strings, one `IncrementalDetokenizer` per request.

Token ids in, text deltas out. A token does not always end on a character boundary (byte-level BPE splits
multi-byte UTF-8 characters; SentencePiece adds a leading space depending on the previous token), so each new
token is decoded together with a few tokens before it: the text of tokens [prefix_offset, read_offset) is already
out, and the text of [prefix_offset, end) minus it is the new text, unless it ends in a replacement character (an
incomplete character: wait for the next token). Stop strings are searched in the text; while the request runs,
the last `longest stop string - 1` characters are held back so a stop string split across tokens is never
streamed. On a match the text is cut before the stop string and the caller ends the request.
"""

from __future__ import annotations

# Tokens before the first new one that are decoded with it, for the context a tokenizer's decoder needs
# (a leading space, a byte sequence that started earlier).
PREFIX_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True):
        """`tokenizer`: anything with `decode(ids, skip_special_tokens=...)` (a transformers tokenizer)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_ids[-PREFIX_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # the output text so far (cut before a stop string once one matched)
        self._num_sent = 0  # characters of `text` already handed out
        self.stop_string: str | None = None  # the stop string that matched, if one did

    def add_token(self, token_id: int) -> bool:
        """Decodes one new token into `text`; True when a stop string now matches (the text is cut before it)."""
        if self.stop_string is not None:
            return True
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return False  # nothing new yet, or a character whose remaining bytes are in the next token
        new_text = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        # A match can start up to len(stop) - 1 characters before the new text.
        start = max(len(self.text) - self._hold, 0)
        self.text += new_text
        return self._find_stop(start)

    def step(self, token_id: int, finish_reason: str | None) -> tuple[str, str | None]:
        """One new token of the request, with the engine's finish reason -> (text delta, finish reason). A stop
        token ends the text without being part of it; a stop string the token completes makes the reason "stop"
        (the caller ends the request if the engine had not)."""
        if finish_reason != "stop" and self.add_token(token_id):
            finish_reason = "stop"
        return self.take_delta(is_finished=finish_reason is not None), finish_reason

    def take_delta(self, is_finished: bool) -> str:
        """The text not handed out yet; while running, minus a tail that could be the start of a stop string."""
        end = len(self.text) if is_finished or self.stop_string is not None else len(self.text) - self._hold
        if end <= self._num_sent:
            return ""
        delta = self.text[self._num_sent:end]
        self._num_sent = end
        return delta

    def _find_stop(self, start: int) -> bool:
        best = None
        for stop in self.stop:
            index = self.text.find(stop, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        self.text, self.stop_string = self.text[:best[0]], best[1]
        return True

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
