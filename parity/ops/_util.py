"""Helpers shared by the record modules."""
from __future__ import annotations

ROWS = {"inputs": {"x": 0}, "outputs": {"y": 0}}
