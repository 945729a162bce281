import copy, time, numpy as np, torch, sys
sys.path.insert(0, "tests/optimized")
import optimized, reference
from reference.config import KimiConfig
from reference.synthetic import SyntheticSource
from test_model_parity import PROMPT, check_logits, _float32_parity
BK = None
for preset in ["tiny", "medium"]:
    cfg = KimiConfig.from_name(preset); src = SyntheticSource(cfg, 0)
    m = optimized.load(src, device="cuda", dtype="bfloat16", backends=BK)
    t0 = time.time()
    logits, cache = m.prefill(PROMPT)
    steps, toks = [logits[-1]], [int(logits[-1].argmax())]
    for _ in range(63):
        s, cache = m.decode(toks[-1], cache); steps.append(s); toks.append(int(s.argmax()))
    ids = PROMPT + toks[:-1]
    rec = m.forward(ids)[len(PROMPT)-1:].argmax(-1).tolist()
    print(preset, "64 steps", time.time()-t0, "s; incremental == recompute:", rec == toks,
          "first diff", next((i for i,(a,b) in enumerate(zip(rec,toks)) if a!=b), None))
    tr = {}; ref = reference.load(src).forward(ids, trace=tr)
    try:
        r = check_logits(cfg, src, torch.stack(steps).cpu(), ref[7:], tr["final_norm"][7:], np.arange(7, len(ids)), "bfloat16", "x")
        print(preset, "bf16 worst units", r)
    except AssertionError as e: print("BOUND FAIL", e)
# batched == alone with tile 64
cfg = KimiConfig.from_name("tiny")
m = optimized.load(SyntheticSource(cfg, 2), device="cuda", dtype="bfloat16", backends=BK)
rng = np.random.default_rng(0); B = 9
prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 70, B)]
pool = m.new_pool(B)
seqs = [m.prefill(p, cache=pool.new_sequence())[1] for p in prompts]
pa, sa = copy.deepcopy((pool, seqs))
nxt = rng.integers(0, cfg.vocab_size, (3, B)).tolist()
batched = [m.decode_batch(nxt[k], seqs)[0] for k in range(3)]
ok = all(torch.equal(m.decode(nxt[k][b], sa[b])[0], batched[k][b]) for b in range(B) for k in range(3))
print("batched == alone (tile 64):", ok)
# without the tile (to show it matters): tile = B


print("medium fp32:")
import optimized.model as om
orig = optimized.load
optimized.load = lambda src, **kw: orig(src, backends=BK, **kw)
print(_float32_parity(SyntheticSource(KimiConfig.from_name("medium"), 1), decode_steps=2, split=5))
print(_float32_parity(SyntheticSource(KimiConfig.from_name("small"), 3), decode_steps=2, split=5))
print("48B:", flush=True)
t0 = time.time()
src = SyntheticSource(KimiConfig.from_name("kimi-linear-48b"), 0)
m = orig(src, device="cuda", dtype="bfloat16", backends=BK)
torch.cuda.synchronize(); print("load", time.time()-t0, "s; weights GB", m.weights.nbytes()/1e9, "peak GB", torch.cuda.max_memory_allocated()/1e9, flush=True)
t0 = time.time(); l, c = m.prefill(list(range(100, 164))); torch.cuda.synchronize(); print("prefill 64", time.time()-t0, l.shape, l.float().std().item(), flush=True)
for k in range(3):
    t0 = time.time(); s, c = m.decode(int(s.argmax()) if k else int(l[-1].argmax()), c); torch.cuda.synchronize(); print("decode", time.time()-t0, flush=True)
