"""`hybrid-convert` entry point (the converter lands with its own issue)."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("hybrid-convert: not yet available; LLM(path) loads HuggingFace checkpoints directly for now",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
