"""The registry with the real optimized ops, on CPU under the Triton interpreter: every op reaches
lifted (float32) and production (bfloat16) certification, its launch counter proves the kernel
ran, every mutant is killed (teeth printed) and both controls are rejected; run-to-run outputs are
bitwise identical."""
import pytest

from parity import ops
from parity.certify import certify_op, cpu_threads

OPS = ops.names()
# numpy evaluates masked-off padding lanes under the interpreter; their 0/0 never reaches memory
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.fixture(autouse=True, scope="module")
def one_thread(parity_device):
    with cpu_threads(parity_device):
        yield


@pytest.mark.parametrize("op", OPS)
def test_the_optimized_op_is_certified_at_lifted_and_production_precision(op):
    cert = certify_op(ops.get(op), candidate="optimized", dtypes=("float32", "bfloat16"), examples=1)
    print(f"{op}: worst " + ", ".join(f"{d} {r.worst_ratio:.3g}" for d, r in cert.runs.items())
          + "; teeth " + ", ".join(f"{m} {t:.3g}" for m, t in cert.teeth().items()))
    why = "\n".join(cert.reasons())
    assert {"lifted", "production"} <= set(cert.reached()), why
    for d, r in cert.runs.items():
        assert r.kernel_ran is True, f"{d}: {op}'s counter did not move"
        assert all(m.killed for m in r.mutants.values()), why
        assert all(r.controls.values()), why
        assert r.bytes.get("run_to_run") is True, why
