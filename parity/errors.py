"""Errors the CLI reports as one line (exit 2)."""


class InputError(Exception):
    """Unusable input: a missing or broken checkpoint, a bad argument. The message is one line
    that names the offending thing."""
