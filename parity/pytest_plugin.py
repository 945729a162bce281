"""pytest plugin (entry point ``pytest11``): the parity fixtures, ``--parity-device``, the
``parity_gpu`` marker, and the hypothesis profile.

- ``--parity-device auto|cpu|cuda`` (default ``auto``: cuda when a GPU is present, else cpu under the
  Triton interpreter): where the ``parity_device`` fixture points; tests
  marked ``parity_gpu`` (and every test when ``cuda`` is asked for without a GPU) skip cleanly,
  naming the reason.
- Fixtures: ``parity_device``, ``assert_parity`` (``assert_parity("kda.chunked", inputs)``, see
  :func:`parity.testing.assert_parity`; the device defaults to ``parity_device``), ``parity_registry``
  (the records by name, from ``parity.ops.records()``). Parametrize over the registry with
  ``parity.testing.op_names()``.
- Hypothesis: the profiles of :mod:`parity.strategies` are registered and the one named by
  ``PARITY_HYPOTHESIS_PROFILE`` (default ``ci``) is loaded for the whole session.

Nothing heavy is imported at load time: suites that never touch torch keep running without it.
"""
from __future__ import annotations

import pytest

_GPU_REASON = "needs a CUDA GPU (parity_gpu); none is available"


def pytest_addoption(parser):
    group = parser.getgroup("parity")
    group.addoption("--parity-device", action="store", default="auto", choices=("auto", "cpu", "cuda"),
                    help="device for the parity fixtures (default auto: cuda if available, else cpu)")


def pytest_configure(config):
    config.addinivalue_line("markers", "parity_gpu: the test needs a CUDA GPU; skipped cleanly without one")
    from parity.strategies import load_profile

    load_profile()


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    wants_cuda = config.getoption("--parity-device") == "cuda"
    marked = [it for it in items if it.get_closest_marker("parity_gpu")]
    if not marked and not wants_cuda:
        return
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason=_GPU_REASON)
    for it in marked:
        it.add_marker(skip)


@pytest.fixture(scope="session")
def parity_device(pytestconfig) -> str:
    device = pytestconfig.getoption("--parity-device")
    if device == "auto":
        return "cuda" if _has_gpu() else "cpu"
    if device == "cuda" and not _has_gpu():
        pytest.skip("--parity-device cuda: no CUDA GPU available")
    return device


@pytest.fixture
def assert_parity(parity_device):
    from parity.testing import assert_parity as check

    def run(op, inputs, **kw):
        kw.setdefault("device", parity_device)
        return check(op, inputs, **kw)

    return run


@pytest.fixture(scope="session")
def parity_registry():
    from parity import ops  # here, not at load: the plugin imports nothing heavy

    return {r.name: r for r in ops.records()}
