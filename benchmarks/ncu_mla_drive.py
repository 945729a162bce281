"""Drive mla.paged_decode a few times at B x S (for ncu): python benchmarks/ncu_mla_drive.py B S [warps]"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.tune_mla import Case  # noqa: E402

B, S = int(sys.argv[1]), int(sys.argv[2])
case = Case(B, S, torch.Generator(device="cuda").manual_seed(0))
fn = case.call(None)
for _ in range(8):
    fn()
torch.cuda.synchronize()
