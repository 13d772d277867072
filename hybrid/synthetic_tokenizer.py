"""A tokenizer for a synthetic model (`hybrid.synthetic`), which has none, for what needs one: grammar-constrained
decoding (`hybrid.guided`) compiles its grammars against a vocabulary, and what a grammar costs per step grows with
the vocabulary's size. So the vocabulary is as large as the model's (`vocab_size` less a padding, as real
checkpoints pad theirs) and of the kinds of pieces real ones hold: a byte-level BPE, built offline and
deterministically from a seed without training: the 256 byte symbols, then pieces of a seeded generator (words of
English-like syllables, with and without a leading space and capitalised, digit runs, runs of code and JSON
punctuation and whitespace), each with all its prefixes, so that every token is the merge of its prefix and its
last symbol and the merges spell every token. Nothing is downloaded; the same `vocab_size` and `seed` give the
same tokenizer.
"""

from __future__ import annotations

import random
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
PADDED_TOKENS = 128  # rows of the model's vocabulary past the tokenizer's, as checkpoints pad their embeddings
CONSONANTS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "ch", "sh",
              "th", "st", "tr", "pr", "qu")
VOWELS = ("a", "e", "i", "o", "u", "y", "ea", "ou", "io")
PUNCTUATION = '{}[]():;,."\'=<>/-_+*&%$#@!?|\\`~^ \n\t'


def byte_symbols() -> list[str]:
    """The byte-level alphabet: byte b's symbol. Printable Latin-1 bytes stand for themselves, the others (controls,
    space, ...) for the characters from U+0100 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, num_shifted = {}, 0
    for byte in range(256):
        if byte in kept:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + num_shifted)
            num_shifted += 1
    return [symbols[byte] for byte in range(256)]


def _piece(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.75:
        word = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(1, 4)))
        word = word.capitalize() if rng.random() < 0.2 else word
        return (" " + word) if rng.random() < 0.6 else word
    if kind < 0.85:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
    return "".join(rng.choice(PUNCTUATION) for _ in range(rng.randint(2, 4)))


def build_synthetic_tokenizer(vocab_size: int, seed: int = 0):
    """A transformers fast tokenizer of `vocab_size - PADDED_TOKENS` tokens (EOS the last)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    num_tokens = vocab_size - PADDED_TOKENS - 1  # the EOS token is the last
    if num_tokens < 256:
        raise ValueError(f"vocab_size {vocab_size}: a byte-level tokenizer needs at least {256 + PADDED_TOKENS + 1}")
    to_symbol = byte_symbols()
    vocab = {symbol: i for i, symbol in enumerate(to_symbol)}
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    while len(vocab) < num_tokens:
        token = "".join(to_symbol[b] for b in _piece(rng).encode("utf-8"))
        for end in range(2, len(token) + 1):  # the prefixes first: each token is the merge of two earlier ones
            if token[:end] not in vocab and len(vocab) < num_tokens:
                vocab[token[:end]] = len(vocab)
                merges.append((token[:end - 1], token[end - 1]))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   clean_up_tokenization_spaces=False)


def write_synthetic_tokenizer(path: str | Path, vocab_size: int, seed: int = 0) -> None:
    """Saves `build_synthetic_tokenizer`'s tokenizer in `path` (a synthetic model's directory), unless one is
    there."""
    if (Path(path) / "tokenizer.json").is_file():
        return
    build_synthetic_tokenizer(vocab_size, seed).save_pretrained(str(path))
