"""pytest plugin (entry point ``pytest11``): the parity fixtures, ``--parity-device``, the
``parity_gpu`` and ``parity_interpreter`` markers, and the hypothesis profile.

- ``--parity-device auto|cpu|cuda`` (default ``auto``: cuda when a GPU is present, else cpu under the
  Triton interpreter): where the ``parity_device`` fixture points, the one place a test learns its
  device (tests never name one); tests marked ``parity_gpu`` skip cleanly, naming the reason,
  unless that device is cuda (and every test skips when ``cuda`` is asked for without a GPU).
- ``parity_interpreter``: the test needs the Triton interpreter on the CPU. Where this process
  compiles kernels for a GPU (the interpreter is chosen when kernels are defined), the test runs in
  a child pytest process with ``TRITON_INTERPRET=1`` and no visible GPU, exactly as on a machine
  without one; its result and output come back to this process.
- Fixtures: ``parity_device``, ``assert_parity`` (``assert_parity("kda.chunked", inputs)``, see
  :func:`parity.testing.assert_parity`; the device defaults to ``parity_device``),
  ``assert_certified`` (``assert_certified("kda.chunked", my_chunk_kda)``: your implementation
  certified on drawn inputs, :func:`parity.testing.assert_certified`), ``parity_registry``
  (the records by name, from ``parity.ops.records()``). Parametrize over the registry with
  ``parity.testing.op_names()``.
- Hypothesis: the profiles of :mod:`parity.strategies` are registered and the one named by
  ``PARITY_HYPOTHESIS_PROFILE`` (default ``ci``) is loaded for the whole session.
- The backend: ``optimized.use`` of ``--parity-device`` when the session starts, before any test
  module is collected.

Nothing is imported when pytest loads the plugin (it loads in every session of the environment);
the session's configuration imports parity and optimized.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import pytest

# parity, optimized and torch are imported inside the hooks and fixtures below, never at the top:
# pytest loads this plugin in every session of the environment, parity's suites or not

_GPU_REASON = "needs a CUDA GPU (parity_gpu); none is available"


def pytest_addoption(parser):
    group = parser.getgroup("parity")
    group.addoption("--parity-device", action="store", default="auto", choices=("auto", "cpu", "cuda"),
                    help="device for the parity fixtures (default auto: cuda if available, else cpu)")


def pytest_configure(config):
    config.addinivalue_line("markers", "parity_gpu: the test needs a CUDA GPU; skipped cleanly without one")
    config.addinivalue_line("markers", "parity_interpreter: the test needs the Triton interpreter on the CPU; "
                                       "run in a child process where this one compiles for a GPU")
    import optimized   # not at the top: see above
    from parity.strategies import load_profile  # why: not at the top: see above

    load_profile()
    device = config.getoption("--parity-device")
    optimized.use(None if device == "auto" else device)


def _has_gpu() -> bool:
    try:
        import torch   # not at the top: see above
    except ImportError:
        return False
    return torch.cuda.is_available()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    interp = [it for it in items if it.get_closest_marker("parity_interpreter")]
    if interp and not _interpreting() and _has_gpu():   # without a GPU, this process interprets
        _run_in_child(interp)
    device = config.getoption("--parity-device")
    marked = [it for it in items if it.get_closest_marker("parity_gpu")]
    if not marked or (device != "cpu" and _has_gpu()):
        return
    skip = pytest.mark.skip(reason=_GPU_REASON if device != "cpu" else "needs a CUDA GPU (parity_gpu); "
                                                                       "--parity-device cpu")
    for it in marked:
        it.add_marker(skip)


def _run_in_child(items) -> None:
    """Replace each item's set-up and call by its result in a child pytest process under the
    interpreter with no GPU visible (its fixtures are set up there, not here): one child per test
    file, run when the file's first such test comes up."""
    groups: dict = {}
    for it in items:
        groups.setdefault(it.nodeid.split("::")[0], []).append(it)
    for group in groups.values():
        results: dict = {}
        for it in group:
            it.setup = lambda: None
            it.runtest = lambda it=it, group=group, results=results: _child_result(it, group, results)


def _junit_key(nodeid: str) -> tuple:
    """(classname, name) of a test in a JUnit XML, from its node id."""
    path, *scope, name = nodeid.split("::")
    return (".".join([path[:-3].replace("/", "."), *scope]) if path.endswith(".py") else path, name)


def _child_result(item, group, results: dict) -> None:
    if not results:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
        env.update({"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
        with tempfile.TemporaryDirectory() as tmp:
            xml = os.path.join(tmp, "child.xml")
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                   "--parity-device", "cpu", f"--junitxml={xml}", *(it.nodeid for it in group)],
                                  cwd=str(item.config.rootpath), env=env, capture_output=True, text=True)
            results["output"] = f"(rc {done.returncode}):\n{done.stdout[-6000:]}{done.stderr[-3000:]}"
            if os.path.exists(xml):
                for case in ET.parse(xml).getroot().iter("testcase"):
                    kinds = {c.tag: (c.get("message") or "") for c in case}
                    results[(case.get("classname"), case.get("name"))] = kinds
    kinds = results.get(_junit_key(item.nodeid))
    if kinds is None:
        pytest.fail(f"under the interpreter in a child process, {item.nodeid} did not report "
                    f"{results['output']}", pytrace=False)
    if "failure" in kinds or "error" in kinds:
        pytest.fail(f"under the interpreter in a child process: {kinds.get('failure') or kinds.get('error')} "
                    f"{results['output']}", pytrace=False)
    if "skipped" in kinds:
        pytest.skip(f"under the interpreter in a child process: {kinds['skipped']}")


@pytest.fixture(scope="session")
def parity_device(pytestconfig) -> str:
    device = pytestconfig.getoption("--parity-device")
    if device == "auto":
        return "cuda" if _has_gpu() and not _interpreting() else "cpu"
    if device == "cuda" and not _has_gpu():
        pytest.skip("--parity-device cuda: no CUDA GPU available")
    return device


@pytest.fixture
def assert_parity(parity_device):
    from parity.testing import assert_parity as check   # not at the top: see above

    def run(op, inputs, **kw):
        kw.setdefault("device", parity_device)
        return check(op, inputs, **kw)

    return run


@pytest.fixture
def assert_certified(parity_device):
    from parity.testing import assert_certified as certify   # not at the top: see above

    def run(op, candidate, **kw):
        kw.setdefault("device", parity_device)
        return certify(op, candidate, **kw)

    return run


@pytest.fixture(scope="session")
def parity_registry():
    from parity import ops   # not at the top: see above

    return {r.name: r for r in ops.records()}
