"""What one certification is: ``CertifyJob``, the frozen record ``parity certify`` builds from its
arguments and ``parity.certify.run.run_job`` runs, and ``Impl``, one ``--impl`` from the command line
to the certificate: the op, what was written and the candidate loaded from it.

    --impl kda.recurrent=my.py:recurrent   ->   Impl("kda.recurrent", "my.py:recurrent", Candidate)
    --impl fla                             ->   Impl(op, "fla", Candidate) for each op fla adapts
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from parity.registry import OpRecord

from .candidate import Candidate


@dataclass(frozen=True)
class Impl:
    """One implementation certified instead of the named candidate for ``op``: ``spec`` is what
    the user wrote (``module:function``, ``path/to/file.py:function`` or a shorthand such as
    ``fla``; None for a callable handed to the Python API), ``candidate`` what runs (a
    :class:`parity.certify.candidate.Candidate`, or a callable made one with the job's contract)."""

    op: str
    spec: str | None
    candidate: Candidate | Callable


@dataclass(frozen=True)
class CertifyJob:
    """Everything a certification runs (``parity.certify.run.run_job``): ``records`` in order,
    ``dtypes`` each run, ``device`` (None: the candidates' default), ``candidate`` (``optimized`` or
    ``reference-f32``) for every op without an ``Impl``, ``examples`` drawn per op and dtype (None:
    the hypothesis profile's), ``contract`` replacing every candidate's claim, ``cases`` (op name ->
    replayed ``parity.registry.Case``), ``workers`` and ``shard`` (``run.runners``, ``run.units``),
    ``repro`` (a folder for the repro of each failing input)."""

    records: tuple[OpRecord, ...]
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    device: str | None = None
    candidate: str = "optimized"
    examples: int | None = None
    impls: tuple[Impl, ...] = ()
    contract: str | None = None
    cases: Mapping[str, tuple] | None = None
    workers: int | None = None
    shard: tuple[int, int] | None = None
    repro: str | None = None

    def impl(self, op: str) -> Impl | None:
        """The ``Impl`` certified for ``op``, or None (the job's ``candidate`` is)."""
        return next((i for i in self.impls if i.op == op), None)

    def specs(self) -> dict:
        """``{op: spec}`` of the implementations: the certificate's ``impls``."""
        return {i.op: i.spec for i in self.impls}
