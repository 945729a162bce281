"""What the chunked KDA kernels compile to on an H200 (sm_90), without a GPU: registers, stack,
shared memory, and static counts of the instructions that set a kernel's pace (barriers, warp
shuffles, exp2, shared-memory stores, layout conversions). Triton's bundled ptxas does the
compiling, so this runs on a CPU-only machine; a change's register and barrier cost can be seen
before device time is spent timing it. The production configuration: bf16, H = HV = 32,
K = V = 128, chunk 64, the fused gate / l2norm, one sequence.

    python benchmarks/inspect_kda.py [--kernels blocks wy state] [--warps 4] [--dump DIR]

Counts are static (an unrolled loop counts every copy, a runtime loop once) and come from the
Triton installed here, whose register allocation can differ from the device's (triton 3.9 here
gave the blocks kernel 255 registers where the H200's triton 3.6 reported 184 for a close variant).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, don't interpret (before optimized is imported)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the device's default; silences 3.9's notice
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# kernel: (pointer and scalar arguments with their types, constexpr arguments)
KERNELS = {
    "blocks": ({"q": "*bf16", "k": "*bf16", "Gc": "*fp32", "beta": "*fp32", "Ak": "*fp32", "Aq": "*bf16",
                "kg": "*bf16", "qg": "*bf16", "kb": "*bf16", "cu": "*i32", "cidx": "*i32", "scale": "fp64", "T": "i32"},
               dict(H=32, HV=32, K=128, BT=64, BC=16, BK=128, L2NORM=True, IS_VARLEN=False)),
    "wy": ({"kb": "*bf16", "v": "*bf16", "beta": "*fp32", "w": "*bf16", "u": "*bf16",
            "Ak": "*fp32", "cu": "*i32", "cidx": "*i32", "T": "i32"},
           dict(HV=32, K=128, V=128, BT=64, BC=16, LOG2_NB=2, BK=128, BV=64, NV=2, IS_VARLEN=False)),
    "state": ({"kg": "*bf16", "w": "*bf16", "u": "*bf16", "Gc": "*fp32", "vnew": "*bf16", "h": "*bf16",
               "h0": "*fp32", "ht": "*fp32", "cu": "*i32", "co": "*i32", "T": "i32", "NT": "i32"},
              dict(HV=32, K=128, V=128, BT=64, BK=128, BV=16, HAS_H0=True, IS_VARLEN=False)),
}
COUNTS = {"bar.sync": r"\bbar\.sync\b|\bbarrier\.sync\b", "shfl": r"\bshfl\.", "ex2": r"\bex2\.",
          "st.shared": r"\bst\.shared\b", "ld.global": r"\bld\.global\b", "mma": r"\bmma\.sync\b",
          "wgmma": r"\bwgmma\.mma_async\b"}


def compile_kernel(name: str, warps: int, stages: int):
    from optimized.kda import chunk

    fn = getattr(chunk, f"_{name}_kernel")
    sig, const = KERNELS[name]
    # tensors from torch are 16-byte aligned and the launch specializes on it; without these
    # attributes no load would vectorize and the layouts would not be the device's
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a, t in sig.items() if t.startswith("*") or a in ("T", "NT")}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}},
                    constexprs={(fn.arg_names.index(c),): v for c, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def resource_usage(cubin: bytes, tmp: Path) -> str:
    path = tmp / "kernel.cubin"
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True).stdout
    line = next((ln for ln in out.splitlines() if "REG:" in ln), "")
    return " ".join(f for f in line.split() if f.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL"))


def describe(ck, tmp: Path) -> str:
    """One line: resources, then the static instruction counts of a compiled kernel."""
    ptx = ck.asm["ptx"]
    counts = ", ".join(f"{k} {len(re.findall(p, ptx))}" for k, p in COUNTS.items())
    return f"{resource_usage(ck.asm['cubin'], tmp)}; {counts}, convert_layout {ck.asm['ttgir'].count('ttg.convert_layout')}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", nargs="*", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--dump", type=Path, default=None, help="write each kernel's ttgir and ptx here")
    args = ap.parse_args(argv)
    tmp = args.dump or Path(os.environ.get("TMPDIR", "/tmp"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"triton {triton.__version__}, sm_90, {args.warps} warps, {args.stages} stages; bf16, H = HV = 32, "
          "K = V = 128, chunk 64, fused")
    for name in args.kernels:
        ck = compile_kernel(name, args.warps, args.stages)
        print(f"_{name}_kernel: {describe(ck, tmp)}")
        if args.dump:
            (args.dump / f"{name}.ttgir").write_text(ck.asm["ttgir"])
            (args.dump / f"{name}.ptx").write_text(ck.asm["ptx"])


if __name__ == "__main__":
    main()
