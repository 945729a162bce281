"""fla-core's chunk_kda on its safe-gate path (``kda.fused_chunked+lower_bound``), certified on a GPU
under the bounded gate's bound, in bf16 (its float32 chunk-32 fault is the softplus test's, in
test_certify_impl.py). The longest test of the suite (fla compiles and autotunes its chunked kernels
for each drawn shape: 355 s for six inputs on an H100), so it has a file, and a process, of its own,
which benchmarks/check_gpu.sh starts first. Six inputs in one run: a mutant is killed when some
input of the run kills it, and three seeded runs of three inputs each left one alive in two of them."""
import pytest

from parity import ops
from parity.certify import certify_op, cpu_threads

OP = "kda.fused_chunked+lower_bound"


@pytest.mark.parity_gpu
def test_fla_cores_chunked_safe_gate_path_on_a_gpu(parity_device):
    from parity.peers import implementations

    fn = implementations("fla", parity_device)[OP]
    with cpu_threads(parity_device):
        cert = certify_op(ops.get(OP), candidate=fn, dtypes=("bfloat16",), examples=6, device=parity_device)
    assert cert.certified, (OP, cert.contract_summary(), cert.reasons())
