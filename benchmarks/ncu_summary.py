"""Summarize `ncu --page source --csv --print-source sass` output: the SASS lines with the most stall
samples and their leading stall reasons. python benchmarks/ncu_summary.py FILE.csv [top]"""
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
hi = next(i for i, r in enumerate(rows) if any("Source" == c or "Address" in c for c in r))
head, body = rows[hi], rows[hi + 1:]
col = {c: i for i, c in enumerate(head)}
samp = next(c for c in head if "Warp Stall Sampling (All" in c)
stall_cols = [c for c in head if c.startswith("stall_") or "Stall" in c and c != samp and "Not" not in c]
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0
total = sum(num(r[col[samp]]) for r in body if len(r) == len(head))
print("columns:", [c for c in head][:60])
print(f"total samples {total:.0f}")
agg = {}
for r in body:
    if len(r) != len(head):
        continue
    for c in stall_cols:
        agg[c] = agg.get(c, 0) + num(r[col[c]])
print("by reason:", sorted(((round(v / max(total, 1) * 100, 1), c) for c, v in agg.items() if v), reverse=True)[:14])
body = [r for r in body if len(r) == len(head)]
body.sort(key=lambda r: -num(r[col[samp]]))
src = col.get("Source", 1)
for r in body[:top]:
    reasons = sorted(((num(r[col[c]]), c) for c in stall_cols), reverse=True)[:3]
    print(f"{num(r[col[samp]]) / max(total, 1) * 100:5.1f}% {r[col.get('Address', 0)]} {r[src][:60]:60s} "
          + " ".join(f"{c}={v:.0f}" for v, c in reasons if v))
