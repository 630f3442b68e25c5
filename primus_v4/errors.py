"""User-facing errors: the CLI prints their message (what, where, what to do), no traceback."""


class PrimusError(Exception):
    """Bad input or an impossible setting; the message names what was wrong and where."""


class ConfigError(PrimusError):
    """A config file, key or value that cannot be used."""


class DataError(PrimusError):
    """A corpus, tokenizer or pack cache that cannot be used."""


class CheckpointFormatError(ValueError):
    """A checkpoint directory or one of its tensors is not what the reader or caller expects."""
