"""``parity certify`` as a library: certify registered ops against the float64 reference.

    from parity.certify import certify_op
    cert = certify_op(parity.ops.get("kda.chunked"), dtypes=("float32",), device="cpu")

Modules: ``job`` (``CertifyJob``, what one certification runs; ``Impl``, one ``--impl``), ``run``
(the driver: drawn inputs, mutants, controls, verdicts), ``candidate`` (what is certified: the
optimized op, the float32 stand-in, an outside implementation), ``check`` (one op
on one input: rounding, the reference, the call, the judgement), ``pool`` (worker processes),
``results`` (the certificate's typed records), ``report`` (its JSON and tables), ``repro`` (a
standalone repro of a failing input), ``fingerprint`` (the nearest known bug of a failure),
``search`` (``parity search``: the worst input of an op).
"""
from .job import CertifyJob, Impl
from .run import certify, certify_op, cpu_threads, merge, run_job, runners, units

__all__ = ["CertifyJob", "Impl", "certify", "certify_op", "cpu_threads", "merge", "run_job", "runners", "units"]
