"""What ``diff`` and ``golden`` read alike from their arguments: ``--variant NAME=VALUE`` (the
semantic variants both paths expose, spec §(e)), ``--backend FAMILY=reference`` and
``--reference-device``. Every unusable value raises ``InputError`` naming it."""
from __future__ import annotations

from kimi.config import kda_gate_name
from optimized.backends import resolve
from parity.diff.reference_device import DEVICES
from parity.diff.setup import one_line
from parity.errors import InputError
from reference.checks import kda_gate_bound

VARIANTS = {  # name -> parser of its value (spec §(e): the semantic variants both paths expose)
    "moe_combine": lambda v: _choice("moe_combine", v, ("unbiased", "biased")),
    "kv_norm_eps": lambda v: _positive_float("kv_norm_eps", v),
    "kda_gate": lambda v: _kda_gate(v),
}


def _kda_gate(value):
    """``softplus`` or ``lower_bound:<b>`` (b in [-5, 0)), as the models take it."""
    try:
        return kda_gate_name(kda_gate_bound(value))
    except ValueError:
        raise InputError(f"--variant kda_gate={value}: expected softplus or lower_bound:<b> with b in "
                         "[-5, 0)") from None


def _choice(name, value, allowed):
    if value not in allowed:
        raise InputError(f"--variant {name}={value}: expected one of {', '.join(allowed)}")
    return value


def _positive_float(name, value):
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not x > 0 or x == float("inf"):
        raise InputError(f"--variant {name}={value}: expected a positive number")
    return x


def _pairs(items, flag) -> list[tuple[str, str]]:
    out = []
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise InputError(f"{flag} {item!r}: expected NAME=VALUE")
        out.append((name.strip(), value.strip()))
    return out


def parse_variants(items: list[str] | None) -> dict:
    """``["moe_combine=biased", ...]`` -> keyword arguments of ``reference.load`` / ``optimized.load``."""
    out = {}
    for name, value in _pairs(items, "--variant"):
        if name not in VARIANTS:
            raise InputError(f"--variant {name}: unknown variant; known: {', '.join(VARIANTS)}")
        out[name] = VARIANTS[name](value)
    return out


def parse_backends(items: list[str] | None) -> dict:
    """``["kda=reference", ...]`` -> the ``backends`` argument of ``optimized.load`` (validated by
    ``optimized.backends.resolve``: its message names the unknown family or value)."""
    out = dict(_pairs(items, "--backend"))
    try:
        resolve(out)
    except ValueError as exc:
        raise InputError(f"--backend: {one_line(exc)}") from None
    return out


def add_reference_device(parser) -> None:
    """``--reference-device cpu|cuda|auto`` (``parity.diff.reference_device``)."""
    parser.add_argument("--reference-device", choices=DEVICES, default="auto",
                        help="where the float64 reference runs: cpu (NumPy, every core), cuda (torch "
                             "float64, sharing the optimized model's weights on the GPU) or auto "
                             "(default: cuda when a GPU is present and the reference fits beside the "
                             "engine, else cpu)")
