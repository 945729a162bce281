"""Error-bound models: per op, the largest error an implementation at a given precision may make,
element by element, derived from unit roundoffs, magnitudes and reduction lengths
(docs/error-bounds.md). ``core`` has the arithmetic and ``model`` a whole model's logits; each op
family's models are its ``bounds`` module (``parity/ops/<family>/bounds.py``).

A model is ``model(inputs, kwargs, ref, precision) -> {output: bound array}``: ``inputs`` the
float64 values the candidate saw (after rounding to its dtype), ``ref`` the reference outputs on
those inputs, ``precision`` a :class:`Precision`. Exactly compared outputs get a bound of 0.
"""
from .core import (LAMBDA, U_REFERENCE, UNIT_ROUNDOFF, Precision, dtype_name, gamma,  # noqa: F401
                   precision_for, prob_sum, unit_roundoff)
