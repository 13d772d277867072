"""Error types. Every message is one line that names the file, tensor or parameter at fault."""


class HybridError(Exception):
    """Base class of the errors this project raises on purpose."""


class ConfigError(HybridError, ValueError):
    """A config.json (or a command-line option) that cannot be used, and what to change."""


class CheckpointError(HybridError, ValueError):
    """A checkpoint whose files or tensors do not match what the model expects."""


class OutputError(HybridError, OSError):
    """An output directory that cannot be written (permissions, disk full, a conversion of other options)."""
