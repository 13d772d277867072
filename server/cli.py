"""`hybrid-serve` entry point (the server lands with its own issue)."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("hybrid-serve: not yet available; use the Python API (`from hybrid import LLM`) for now", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
