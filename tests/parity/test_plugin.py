"""The pytest plugin: assert_parity in a user's test, registry parametrization, --parity-device,
parity_gpu tests skipping cleanly without a GPU, parity_interpreter tests under the interpreter (in a
child process on a GPU machine)."""
import os
import subprocess
import sys
import textwrap

import torch

PY = sys.executable

USER_TEST = textwrap.dedent("""
    import numpy as np
    import pytest
    import torch

    from parity.testing import op_names

    def test_silu_matches(assert_parity):
        x = np.linspace(-8, 8, 64)
        j = assert_parity("elementwise.silu", {"x": x}, dtype="bfloat16")
        assert j.kernel_ran and j.ratio <= 1

    def test_a_wrong_candidate_fails_with_its_worst_elements(assert_parity):
        x = np.linspace(-8, 8, 64)
        with pytest.raises(AssertionError, match="past the bound"):
            assert_parity("elementwise.silu", {"x": x}, candidate=lambda t: torch.sigmoid(t))

    def test_my_silu_is_certified(assert_certified):
        cert = assert_certified("elementwise.silu", torch.nn.functional.silu, dtypes=("float32",), examples=1)
        assert cert.certified and cert.implementation["package"] == "torch"

    def test_a_wrong_implementation_is_not_certified(assert_certified):
        with pytest.raises(AssertionError, match="not certified"):
            assert_certified("elementwise.silu", torch.sigmoid, dtypes=("float32",), examples=1)

    @pytest.mark.parametrize("op", op_names())
    def test_registry_is_parametrizable(op, parity_registry):
        assert op in parity_registry

    @pytest.mark.parity_gpu
    def test_needs_a_gpu(parity_device):
        assert torch.cuda.is_available()

    @pytest.mark.parity_interpreter
    def test_runs_under_the_interpreter_with_no_gpu_visible(parity_device):
        import optimized
        assert optimized.interpreting() and not torch.cuda.is_available()
""")


def _run(tmp_path, *args):
    (tmp_path / "test_user.py").write_text(USER_TEST)
    env = dict(os.environ)
    return subprocess.run([PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args, "test_user.py"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)


def test_a_users_suite_gets_the_fixtures_and_gpu_tests_skip_cleanly(tmp_path):
    out = _run(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "1 skipped" in out.stdout and "needs a CUDA GPU" in out.stdout


def test_asking_for_cuda_without_a_gpu_skips_instead_of_failing(tmp_path):
    if torch.cuda.is_available():
        return
    out = _run(tmp_path, "--parity-device", "cuda", "-k", "silu_matches or needs_a_gpu")
    assert out.returncode == 0, out.stdout[-3000:]
    assert "2 skipped" in out.stdout


def test_xdist_workers_are_pinned_one_per_gpu_within_the_outer_visible_set():
    """tests/conftest.py: worker gwN sees the (N mod n)th of the n GPUs an outer CUDA_VISIBLE_DEVICES
    allows, set before torch starts CUDA; one GPU, or no xdist worker, leaves it as it is."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import os, tests.conftest; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"
    for worker, count, outer, want in (("gw0", "4", "4,5,6", "4"), ("gw3", "4", "4,5,6", "4"),
                                       ("gw2", "4", "4, 5", "4"), ("gw1", "2", "0,1", "1"),
                                       ("gw1", "2", "7", "7"), ("", "1", "2,3", "2,3")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
        env.update(CUDA_VISIBLE_DEVICES=outer, PYTEST_XDIST_WORKER=worker, PYTEST_XDIST_WORKER_COUNT=count)
        out = subprocess.run([PY, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == want, (worker, outer, out.stdout, out.stderr[-2000:])
