"""Write a kimi-parity dump (docs/dump-format.md). Needs only NumPy and safetensors: copy it into
your engine's tooling as it is."""
import json
import os
import tempfile

import numpy as np
from safetensors.numpy import save


def write_dump(path, *, config, prompt_ids, tokens, logits, dtype, mode, engine="", traces=None):
    """config: the config.json dict the engine ran; prompt_ids: [P] ints; tokens: [N] ints, the token
    consumed at each step (tokens[0] = prompt_ids[-1]); logits: [N, vocab], row k = the logits after
    consuming tokens[k]; dtype: the engine's compute dtype ("bfloat16", "float16", "float32");
    mode: "forced" (tokens are a plan's) or "free" (the engine's own greedy tokens); traces:
    optional {name: [P - 1 + N, width] array}, one row per position (names: docs/dump-format.md)."""
    def host(x):  # floats as float32 (exact for bf16/fp16 values), ids as int64
        x = np.asarray(x)
        return np.ascontiguousarray(x, dtype=np.int64 if x.dtype.kind in "iu" else
                                    (np.float64 if x.dtype == np.float64 else np.float32))

    logits = host(logits)
    header = {"format": "kimi-parity/dump", "version": 1, "engine": engine, "config": config,
              "prompt_ids": [int(t) for t in prompt_ids], "dtype": dtype, "mode": mode,
              "steps": int(logits.shape[0])}
    tensors = {"logits": logits, "tokens": host(np.asarray(tokens, dtype=np.int64))}
    tensors.update({name: host(x) for name, x in (traces or {}).items()})
    data = save(tensors, metadata={"kimi-parity": json.dumps(header)})
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    try:  # a reader sees the whole file or none: write beside it, then rename over it
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
