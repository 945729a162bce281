"""Moved to ``parity.certify.results``; this name is kept for code written before the move (parity/_moved.py)."""
from parity._moved import alias

alias(__name__)
