"""The error every release-checkpoint reader and writer raises."""


class ReleaseFormatError(ValueError):
    """A release directory or one of its tensors is not what the reader or caller expects."""
