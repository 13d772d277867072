"""The built-in demo model that `hybrid-serve` serves when no `--model` is given: a small Qwen3-MoE checkpoint with
RANDOM weights (its output is gibberish; it exists to try the API), a byte-level BPE tokenizer trained here on a
few built-in English sentences, and a ChatML chat template with Hermes-style tools. Nothing is downloaded.

`demo_model()` builds it once into the user's cache (`$XDG_CACHE_HOME/hybrid/demo-<version>`, else
`~/.cache/hybrid/...`): a temporary directory holds the HuggingFace checkpoint and its `hybrid-convert` output
(int8 CPU experts), and the converted directory is renamed into place only when complete. A start killed while
building leaves its temporary directory behind; the next start removes it (`remove_stale_builds`): a build holds
an exclusive lock on its directory's lock file for as long as it runs, and the kernel drops the lock when the
process ends, however it ends, so a directory whose lock can be taken has no builder any more.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

LOCK_FILE = ".lock"
# A build directory without a lock file is either a moment old (the lock comes right after the directory) or left
# by a build from before the lock existed; the latter is removed once it is this old.
STALE_UNLOCKED_SECONDS = 3600
DEMO_PREFIX = ".demo-"  # the temporary directories of the default cache location, any version's

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Tags the parsers read from the decoded text: added tokens that decoding keeps (not "special").
TEXT_TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model with random weights writes words at random, but the
server around it behaves like any other: it reads requests, batches them, streams tokens and counts them.
Hello! How are you today? I am fine, thank you. What is the weather like in Paris? It is sunny and warm.
Please call a function to get the weather for a city, then answer the question in one short sentence.
Experts live in memory on the processor while attention runs on the graphics card; the scheduler keeps both busy.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ' " ( ) [ ] { } < > / \\ - _ = + * & % $ # @.
JSON looks like {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}} and lists like [1, 2].
def add(a, b):
    return a + b
Once upon a time there was a little robot who liked to count tokens and tell stories about the sea.
"""

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class DemoSize:
    """The demo model's shape; tests build smaller ones."""

    vocab_size: int = 1024  # BPE target; the trained vocabulary may come out smaller
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 16
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 4096
    seed: int = 0
    special_tags: tuple[str, ...] = ()  # more special tokens (tests: other tool-call formats' tags)


def demo_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    try:
        version = metadata.version("hybrid")
    except metadata.PackageNotFoundError:
        version = "dev"
    return Path(root) / "hybrid" / f"demo-{version}"


def demo_model(path: Path | None = None, size: DemoSize | None = None) -> Path:
    """The converted demo model's directory, built first if it is not there yet."""
    final = Path(path) if path is not None else demo_cache_dir()
    if final.parent.is_dir():
        remove_stale_builds(final.parent, (f".{final.name}-", DEMO_PREFIX))
    if (final / "hybrid.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    lock = _lock_build(work)
    try:
        build_checkpoint(work / "hf", size or DemoSize())
        _convert(work / "hf", work / "model")
        try:
            os.rename(work / "model", final)
        except OSError:
            if not (final / "hybrid.json").is_file():  # another process finishing first is fine
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.close(lock)
    return final


def _lock_build(work: Path) -> int:
    """Locks `work` for this process's build: the lock file is locked before it takes its name, so no other
    process ever sees it unlocked while the build runs. Returns the descriptor that holds the lock."""
    fd = os.open(work / f"{LOCK_FILE}.new", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(work / f"{LOCK_FILE}.new", work / LOCK_FILE)
    return fd


def remove_stale_builds(parent: Path, prefixes: tuple[str, ...]) -> list[Path]:
    """Removes the temporary build directories in `parent` (names starting with one of `prefixes`) whose
    builder is gone; returns them. A directory whose lock is held is left alone."""
    removed = []
    for entry in parent.iterdir():
        if entry.name.startswith(prefixes) and entry.is_dir() and _is_abandoned(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _is_abandoned(work: Path) -> bool:
    try:
        fd = os.open(work / LOCK_FILE, os.O_RDWR)
    except FileNotFoundError:
        try:
            return time.time() - work.stat().st_mtime > STALE_UNLOCKED_SECONDS
        except OSError:
            return False
    except OSError:
        return False  # not ours to judge (permissions): leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live build holds it
    finally:
        os.close(fd)  # also drops the lock taken just now
    return True


def build_checkpoint(path: Path, size: DemoSize) -> Path:
    """The HuggingFace checkpoint (weights, config, generation config, tokenizer) in `path`."""
    import torch
    import transformers as T

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(size.vocab_size, size.special_tags)
    tokenizer.save_pretrained(path)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = T.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=size.hidden_size, num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads, num_key_value_heads=size.num_kv_heads,
        head_dim=size.hidden_size // size.num_heads, intermediate_size=2 * size.hidden_size,
        moe_intermediate_size=size.moe_intermediate_size, num_experts=size.num_experts,
        num_experts_per_tok=size.num_experts_per_tok, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=size.max_position_embeddings, tie_word_embeddings=False,
        # a wide initialisation so that greedy output varies from token to token instead of repeating one
        initializer_range=0.5, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"])
    with torch.random.fork_rng():  # seeded weights without touching the caller's random state
        torch.manual_seed(size.seed)
        model = T.Qwen3MoeForCausalLM(config)
    model.generation_config = T.GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"])
    from transformers.utils import logging as hf_logging

    had_progress_bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a shard progress bar in the server's log says nothing
    try:
        model.save_pretrained(path)
    finally:
        if had_progress_bar:
            hf_logging.enable_progress_bar()
    return path


def build_tokenizer(vocab_size: int, special_tags: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer trained on `CORPUS`, with ChatML special tokens, the parser tags and
    `special_tags` (special tokens, as other models' tokenizers have their tool-call tags)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TEXT_TAGS])
    tokenizer.add_tokens([AddedToken(tag, special=True, normalized=False) for tag in special_tags])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=DemoSize.max_position_embeddings,
        clean_up_tokenization_spaces=False)


def _convert(source: Path, dst: Path) -> None:
    from convert.options import ConvertOptions
    from convert.pipeline import convert

    convert(source, dst, ConvertOptions(threads=1), progress=False)


def describe(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    return (f"demo Qwen3-MoE, random weights: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
            f"{config.get('num_experts', config.get('num_local_experts'))} experts, vocab {config['vocab_size']}")
