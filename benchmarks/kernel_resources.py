"""Registers and spills of the Triton kernels a KDA prefill launches, compiled for a GPU on a machine
without one (Triton's own compiler and ptxas; no driver, no device).

    python3 benchmarks/kernel_resources.py [--arch 90] [--gates softplus bounded] [--chunk-sizes 64 16]
        [--heads 32] [--launches '{}' '{"blocks_warps": 4}'] [--opcodes 8] [--json out.json]

``kda.fused_chunked`` is called on CPU tensors of the production configuration (bf16, K = V = 128)
with optimized's kernel launch replaced by a recorder, so every launch a form makes (gate, chunk
size, ``ChunkLaunch``) is seen with its real arguments, constexprs, warps, stages and register cap.
Each is compiled for ``sm_<arch>a`` (``sm_<arch>`` below 90) with the specializations a launch
would get (16-byte aligned pointers, integers divisible by 16), and ``ptxas -v`` reports its
registers and spill bytes; ``CTAs/SM`` is the residency the registers and shared memory allow on an
H100/H200 (64K registers, 228 KiB, at most 64 warps); ``instr`` counts the SASS instructions of the
cubin (static, Triton's ``nvdisasm``: loops count once), and ``--opcodes N`` prints each launch's N
most frequent opcodes beside it.

The state pass's per-grid form is a GPU's choice, not made for CPU tensors: name it
(``'{"state_transposed": true}'``) to see the transposed pass.

Run it as a script, in its own process, without ``TRITON_INTERPRET``: a process that chose the
Triton interpreter (``optimized.use("cpu")``) has Triton patched for it and cannot compile for a GPU. A
register count is a property of the compiler as well as of the code, and the Triton here may not be
the GPU machine's: compare forms within one run, and time them with ``kda_forms.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optimized.kda as okda  # noqa: E402
from benchmarks.bench_kda import K, LOWER_BOUND, V  # noqa: E402
import optimized  # noqa: E402
from optimized import _jit, _launch  # noqa: E402
from optimized._interpreter import interpreting  # noqa: E402

SM_COUNT = 132  # H100 and H200: the grid heuristics size against it
REGISTERS_PER_SM, SHARED_PER_SM, WARPS_PER_SM = 65536, 228 * 1024, 64
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int8: "i8", torch.int32: "i32", torch.int64: "i64"}
_DIVISIBLE = [["tt.divisibility", 16]]
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # Triton's ptxas and nvdisasm


@dataclass(frozen=True)
class Resources:
    """One compiled launch: the kernel, its launch options and what ptxas gave it."""
    kernel: str
    warps: int
    stages: int | None
    maxnreg: int | None
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    ctas_per_sm: int
    instructions: int
    opcodes: dict


def record_launches(call) -> list[tuple]:
    """``(kernel, args, kwargs)`` of every launch ``call()`` makes; no kernel runs."""
    seen = []

    def record(kernel, *args, grid, warmup, **kwargs):
        seen.append((kernel, args, kwargs))

    run = _jit.Kernel.run
    sm_count = _launch.sm_count
    _jit.Kernel.run, _launch.sm_count = record, lambda device: SM_COUNT
    try:
        call()
    finally:
        _jit.Kernel.run, _launch.sm_count = run, sm_count
    return seen


def source(kernel, args, kwargs) -> ASTSource:
    """The kernel specialized on these arguments as a launch would specialize it."""
    values = dict(zip(kernel.arg_names, args)) | {n: kwargs[n] for n in kernel.arg_names if n in kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        val = values[p.name] if p.name in values else p.default
        if p.is_constexpr or val is None or (type(val) is int and val == 1):
            signature[p.name], constexprs[(i,)] = "constexpr", val
        elif isinstance(val, torch.Tensor):
            signature[p.name] = "*" + _TYPES[val.dtype]
            if val.data_ptr() % 16 == 0:
                attrs[(i,)] = _DIVISIBLE
        elif isinstance(val, bool):
            signature[p.name] = "i1"
        elif isinstance(val, int):
            signature[p.name] = "i32" if -2**31 <= val < 2**31 else "i64"
            if val % 16 == 0:
                attrs[(i,)] = _DIVISIBLE
        else:
            signature[p.name] = p.annotation or "fp32"
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """``(registers, spill store bytes, spill load bytes)`` from ``ptxas -v`` (the first of Triton's
    ptxas binaries that accepts the PTX's version)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        err = ""
        for name in ("ptxas", "ptxas-blackwell"):
            exe = NVIDIA_BIN / name
            if not exe.exists():
                continue
            gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"  # the arch-specific features, as Triton
            out = subprocess.run([str(exe), "-v", f"--gpu-name={gpu}", str(path), "-o", os.devnull],
                                 capture_output=True, text=True)
            err = out.stderr
            regs = re.search(r"Used (\d+) registers", err)
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", err)
            if out.returncode == 0 and regs and spills:
                return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))
    raise RuntimeError(f"ptxas gave no register count: {err.strip()[-300:]}")


def sass_opcodes(cubin: bytes) -> Counter:
    """Opcode (without modifiers) -> how many instructions of the cubin's SASS carry it."""
    nvdisasm = NVIDIA_BIN / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"nvdisasm: {out.stderr.strip()[-300:]}")
    ops = Counter()
    for line in out.stdout.splitlines():  # "/*0040*/  @!P0 FFMA.FTZ R1, R2, R3, R4 ;"
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def ctas_per_sm(registers: int, warps: int, shared: int) -> int:
    """CTAs one SM holds: registers are allocated per warp in 256s (8 a thread)."""
    per_cta = warps * 32 * (-(-registers // 8) * 8)
    limits = [REGISTERS_PER_SM // per_cta, WARPS_PER_SM // warps]
    if shared:
        limits.append(SHARED_PER_SM // shared)
    return min(limits)


def compile_launch(kernel, args, kwargs, arch: int) -> Resources:
    opts = {n: kwargs[n] for n in ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion") if kwargs.get(n) is not None}
    opts.setdefault("enable_fp_fusion", _jit.FP_FUSION)  # what optimized's launches ask for
    compiled = triton.compile(source(kernel, args, kwargs), target=GPUTarget("cuda", arch, 32), options=opts)
    regs, st, ld = _ptxas_usage(compiled.asm["ptx"], arch)
    warps = opts.get("num_warps", 4)
    shared = compiled.metadata.shared
    ops = sass_opcodes(compiled.asm["cubin"])
    return Resources(kernel.fn.__name__.strip("_"), warps, opts.get("num_stages"), opts.get("maxnreg"),
                     regs, st, ld, shared, ctas_per_sm(regs, warps, shared), sum(ops.values()), dict(ops))


def prefill_inputs(heads: int, T: int = 256):
    """bf16 CPU inputs of ``kda.fused_chunked`` (values never read: nothing runs)."""
    bf = torch.bfloat16
    q, k, g = (torch.zeros(1, T, heads, K, dtype=bf) for _ in range(3))
    v = torch.zeros(1, T, heads, V, dtype=bf)
    beta = torch.zeros(1, T, heads, dtype=bf)
    return q, k, v, g, beta, torch.zeros(heads), torch.zeros(heads * K)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, choices=[80, 86, 89, 90, 100, 120],
                    help="compute capability x10 (90: H100, H200)")
    ap.add_argument("--gates", nargs="+", default=["softplus", "bounded"], choices=["softplus", "bounded"])
    ap.add_argument("--chunk-sizes", nargs="+", type=int, default=[64, 16], choices=[16, 32, 64])
    ap.add_argument("--heads", type=int, default=32, help="value heads (the fused state pass sizes its "
                    f"V block against {SM_COUNT} SMs)")
    ap.add_argument("--launches", nargs="+", default=["{}"], help="JSON of ChunkLaunch fields")
    ap.add_argument("--opcodes", type=int, default=0, metavar="N", help="print each launch's N most "
                    "frequent SASS opcodes")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if interpreting():
        ap.exit(2, "kernel_resources: TRITON_INTERPRET is set: the Triton interpreter cannot compile for a GPU\n")
    optimized.use("cuda")  # the launches are a GPU's (the prepare kernel's exp form asks), never interpreted
    try:
        launches = [replace(okda.ChunkLaunch(), **json.loads(s)) for s in args.launches]
    except (ValueError, TypeError) as e:
        ap.error(f"--launches: {e}")
    x = prefill_inputs(args.heads)
    try:
        rows = _report(args, launches, x)
    except (RuntimeError, triton.CompilationError, OSError) as e:
        ap.exit(2, f"kernel_resources: {str(e).strip().splitlines()[-1]}\n")
    if args.json:
        env = dict(triton=triton.__version__, torch=torch.__version__, arch=args.arch)
        Path(args.json).write_text(json.dumps(dict(environment=env, rows=rows), indent=1) + "\n")


def _report(args, launches, x) -> list[dict]:
    """Compile every launch of every form, printing a line each; the rows."""
    rows = []
    print(f"{'gate':8s} {'chunk':>5s} {'launch':24s} {'kernel':20s} {'warps':>5s} {'regs':>4s} "
          f"{'spill st/ld':>11s} {'shared':>6s} {'CTAs/SM':>7s} {'instr':>6s}")
    for gate in args.gates:
        lb = LOWER_BOUND if gate == "bounded" else None
        for chunk in args.chunk_sizes:
            for spec, launch in zip(args.launches, launches):
                seen = record_launches(lambda: okda.fused_chunked(*x, chunk_size=chunk, launch=launch,
                                                                  lower_bound=lb))
                for kernel, kargs, kwargs in seen:
                    r = compile_launch(kernel, kargs, kwargs, args.arch)
                    rows.append(dict(gate=gate, chunk_size=chunk, launch=json.loads(spec), **asdict(r)))
                    print(f"{gate:8s} {chunk:5d} {spec:24s} {r.kernel:20s} {r.warps:5d} {r.registers:4d} "
                          f"{r.spill_stores:5d}/{r.spill_loads:<5d} {r.shared:6d} {r.ctas_per_sm:7d} "
                          f"{r.instructions:6d}", flush=True)
                    if args.opcodes:
                        top = Counter(r.opcodes).most_common(args.opcodes)
                        print("    " + ", ".join(f"{op} {n}" for op, n in top), flush=True)
    return rows


if __name__ == "__main__":
    main()
