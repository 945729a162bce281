"""Errors the CLI reports as one line (exit 2)."""


class InputError(Exception):
    """Unusable input: a missing or broken checkpoint, a bad argument. The message is one line
    that names the offending thing."""


class CandidateError(ValueError):
    """An implementation that cannot be certified as given (its module does not import, it is not
    callable, its signature or its outputs' count, shapes or dtypes are not the record's, its
    contract is unknown). The message is one line; the CLI exits 2 with it."""


class Unsupported(Exception):
    """Raised by an adapter for an input its implementation does not take (fla's Triton chunk_kda:
    chunk sizes 32 and 64 only): the input is skipped and counted in the certificate, not judged."""
