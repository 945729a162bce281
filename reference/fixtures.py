"""Moved to ``kimi.fixtures``; this name is kept for code written before the move (reference/_moved.py)."""
from reference._moved import alias

alias(__name__)
