"""Moved to ``parity.record.watch``; this name is kept for code written before the move (parity/_moved.py)."""
from parity._moved import alias

alias(__name__)
