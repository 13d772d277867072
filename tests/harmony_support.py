"""openai-harmony as the tests' oracle of the harmony format (a helper module, not a test module). Its encoding
needs OpenAI's o200k_base tiktoken vocabulary, which it downloads (no network here or on CI) unless
TIKTOKEN_ENCODINGS_BASE names a directory that holds it; openai-harmony checks the file's SHA-256, so it is the
real file, shipped compressed in tests/fixtures (tiktoken's vocabulary, MIT licensed)."""

from __future__ import annotations

import lzma
import os
from pathlib import Path

VOCAB = Path(__file__).parent / "fixtures" / "o200k_base.tiktoken.xz"


def load_encoding(directory: Path):
    """The HARMONY_GPT_OSS encoding, its vocabulary unpacked into `directory`."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    (directory / "o200k_base.tiktoken").write_bytes(lzma.decompress(VOCAB.read_bytes()))
    previous = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(directory)
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if previous is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = previous
