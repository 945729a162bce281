"""fla-core's chunk_kda on its safe-gate path (``kda.fused_chunked+lower_bound``), certified on a GPU
under the bounded gate's bound, in bf16 (its float32 chunk-32 fault is the softplus test's, in
test_certify_impl.py). The longest certification of the suite: fla autotunes its chunked kernels for
each shape, and six inputs took 355 s in one test. So its inputs come in parts, each drawing its own
(hypothesis starts every part from its simplest input, then draws by the part's seed), three tests
in a file of their own: pytest-xdist hands so few tests out one to a worker."""
import pytest

from parity import ops
from parity.certify import certify_op, cpu_threads

OP = "kda.fused_chunked+lower_bound"


@pytest.mark.parity_gpu
@pytest.mark.parametrize("part", range(3))
def test_fla_cores_chunked_safe_gate_path_on_a_gpu(part, parity_device):
    from parity.peers import implementations

    fn = implementations("fla", parity_device)[OP]
    with cpu_threads(parity_device):
        cert = certify_op(ops.get(OP), candidate=fn, dtypes=("bfloat16",), examples=3, device=parity_device,
                          seed=part)
    assert cert.certified, (OP, cert.contract_summary(), cert.reasons())
