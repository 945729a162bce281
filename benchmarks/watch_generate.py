"""A program to watch: transformers' KimiLinearForCausalLM generating greedily, nothing of parity in
it. On CUDA with fla-core installed, transformers hands its two KDA functions to fla's kernels
(``chunk_kda``, ``fused_recurrent_kda``) when its model module loads; on the CPU it runs its own
torch functions.

    parity watch --op kda.chunked=fla.ops.kda:chunk_kda --op kda.recurrent=fla.ops.kda:fused_recurrent_kda \\
        --out calls.safetensors -- python benchmarks/watch_generate.py --device cuda
    parity judge calls.safetensors --json certificate.json

(benchmarks/run_watch_gpu.sh runs exactly this on a GPU machine.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import inspect

    import transformers

    from kimi.fixtures import default_checkpoint_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(default_checkpoint_path()))
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    model = transformers.KimiLinearForCausalLM.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    mod = sys.modules[type(model).__module__]
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        fn = getattr(mod, name)
        inner = getattr(fn, "__wrapped__", None)
        impl = None
        if inner is not None:
            impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
        who = getattr(impl, "__module__", "?") + "." + getattr(impl, "__name__", "?") if impl is not None else "its own"
        watched = " (watched)" if getattr(impl, "parity_watched", None) is not None else ""
        print(f"transformers' {name} runs {who}{watched}", flush=True)
        if args.device == "cpu" and inner is not None:
            setattr(mod, name, inspect.unwrap(fn))     # fla's kernels need a GPU: its own torch function
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_tokens),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    print("generated", out[0, args.prompt_tokens:].tolist(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
