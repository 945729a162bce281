"""Helpers for tests that start a child process and signal it."""

from __future__ import annotations

import signal


def sigint_default() -> None:
    """A ``preexec_fn`` that gives the child SIGINT's default handler: a suite started in the
    background (``pytest ... &``) ignores SIGINT, and a child inherits that, so a test's ctrl-c
    would never reach it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
