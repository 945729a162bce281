"""The record of one ``benchmarks/check_gpu.sh`` run: docs/runs/gpu-check.json.

    python3 benchmarks/gpu_check.py OUT_DIR WALL_SECONDS [--write PATH ...] [--resumed-from RUN_DIR]
    python3 benchmarks/gpu_check.py --can-resume RUN_DIR | --unfinished RUN_DIR

Reads what check_gpu.sh left in OUT_DIR: one JUnit XML per pytest selection (``junit-NAME.xml``)
with the selection's exit status (``rc-NAME``), and certify's certificate and exit status
(``certificate-cuda.json``, ``rc-certify``; absent when CHECK_CERTIFY=0). Writes the record to every
``--write`` path and prints one line per test file that did not pass, then the verdict.

The record: ``digest`` (benchmarks/code_digest.py: the code that ran), ``files`` (per test file:
passed / failed / skipped / error counts, and the seconds its tests took, summed over xdist workers),
``selections`` (per pytest process: its exit status; a
process killed by the time limit wrote no XML and counts as an error), ``certify`` (exit status,
ops certified of total, mutants killed of total), ``complete`` (every tests/**/test_*.py file
reported), ``green`` (complete, every selection exited 0 with no failures or errors, and certify
ran and exited 0), the device, torch and triton versions, wall seconds.

A run of the same code can be completed by a second call (check_gpu.sh's ``CHECK_RESUME``): the
first run's reports are unpacked into OUT_DIR, its unfinished selections (a file killed by the time
limit, say) run again and replace theirs, and the record names the first run (``resumed``: its wall
seconds, device and the selections run again); ``wall_seconds`` is the two runs' sum.
"""
from __future__ import annotations

import json
import pathlib
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from code_digest import code_digest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _file_of(classname: str) -> str:
    """tests/parity/test_x.py from a JUnit classname (``tests.parity.test_x`` or ``...test_x.TestY``)."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n]) + ".py"
        if (ROOT / path).is_file():
            return path
    return classname


def _read_rc(path: pathlib.Path):
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def collect(out: pathlib.Path) -> tuple[dict, dict]:
    """(per test file counts, per selection exit status) from the JUnit XMLs and rc files."""
    files: dict = {}
    selections: dict = {}
    for rc_path in sorted(out.glob("rc-*")):
        name = rc_path.name[3:]
        if name == "certify":
            continue
        selections[name] = {"rc": _read_rc(rc_path)}
        xml = out / f"junit-{name}.xml"
        if not xml.is_file():
            selections[name]["note"] = "no JUnit XML (killed by the time limit, or pytest did not start)"
            continue
        for case in ET.parse(xml).getroot().iter("testcase"):
            f = files.setdefault(_file_of(case.get("classname") or case.get("name", "")),
                                 {"passed": 0, "failed": 0, "skipped": 0, "error": 0, "seconds": 0.0})
            f["seconds"] = round(f["seconds"] + float(case.get("time") or 0.0), 1)
            kinds = {child.tag for child in case}
            if "error" in kinds:
                f["error"] += 1
            elif "failure" in kinds:
                f["failed"] += 1
            elif "skipped" in kinds:
                f["skipped"] += 1
            else:
                f["passed"] += 1
    return dict(sorted(files.items())), selections


def certify_summary(out: pathlib.Path) -> dict | None:
    rc = _read_rc(out / "rc-certify")
    if rc is None and not (out / "certificate-cuda.json").exists():
        return None
    summary = {"rc": rc}
    try:
        doc = json.loads((out / "certificate-cuda.json").read_text())
    except (OSError, ValueError):
        summary["note"] = "no certificate written"
        return summary
    ops = doc.get("ops", [])
    summary.update({
        "ops_certified": sum(o.get("verdict") == "certified" for o in ops), "ops_total": len(ops),
        "mutants_killed": sum(o.get("mutants_killed", 0) for o in ops),
        "mutants_total": sum(o.get("mutants_total", 0) for o in ops)})
    return summary


def environment() -> dict:
    env = {"device": None, "torch": None, "triton": None}
    try:
        import torch

        env["torch"] = torch.__version__
        env["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no CUDA device)"
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:  # a record is still written: it says what could not be read
        env["note"] = f"{type(exc).__name__}: {exc}"
    return env


def selection_file(name: str) -> str | None:
    """The test file a selection's name stands for (check_gpu.sh names a selection by its path with
    ``/`` as ``-``)."""
    return next((p.relative_to(ROOT).as_posix() for p in ROOT.glob("tests/**/test_*.py")
                 if p.relative_to(ROOT).with_suffix("").as_posix().replace("/", "-") == name), None)


def unfinished(prev: dict) -> list[str]:
    """The selections of a recorded run that did not exit 0 with a report."""
    return [n for n, s in prev["selections"].items() if s["rc"] != 0 or "note" in s]


def resumable(run: pathlib.Path) -> tuple[dict | None, str]:
    """(the record, "") of a previous run in directory ``run`` (its gpu-check.json and parts.tar.gz)
    that check_gpu.sh may resume, or (None, why not): it must have run this code."""
    try:
        prev = json.loads((run / "gpu-check.json").read_text())
    except (OSError, ValueError) as exc:
        return None, f"no readable gpu-check.json in {run} ({type(exc).__name__})"
    if not (run / "parts.tar.gz").is_file():
        return None, f"no parts.tar.gz in {run}"
    if prev.get("digest") != code_digest(ROOT):
        return None, (f"the run in {run} was of other code (digest {str(prev.get('digest'))[:12]}, "
                      f"this code {code_digest(ROOT)[:12]})")
    return prev, ""


def record(out: pathlib.Path, wall_s: float, resumed: dict | None = None) -> dict:
    """The record of the run whose results are in ``out``; ``resumed``: the record of the earlier
    run of the same code it completes (its reports were unpacked into ``out``, its unfinished
    selections run again), named in the record with its wall time and device."""
    files, selections = collect(out)
    cert = certify_summary(out)
    every = {p.relative_to(ROOT).as_posix() for p in ROOT.glob("tests/**/test_*.py")}
    complete = every <= set(files)
    green = complete and all(s["rc"] == 0 and "note" not in s for s in selections.values()) \
        and all(f["failed"] == 0 and f["error"] == 0 for f in files.values()) \
        and cert is not None and cert["rc"] == 0
    doc = {"format": "kimi-parity/gpu-check", "digest": code_digest(ROOT), "green": green,
           "complete": complete,
           **environment(), "wall_seconds": round(wall_s, 1), "certify": cert,
           "selections": selections, "files": files}
    if resumed is not None:
        doc["resumed"] = {"wall_seconds": resumed.get("wall_seconds"), "device": resumed.get("device"),
                          "rerun": unfinished(resumed)}
        doc["wall_seconds"] = round(wall_s + (resumed.get("wall_seconds") or 0.0), 1)
    return doc


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] in ("--can-resume", "--unfinished"):
        prev, why = resumable(pathlib.Path(argv[1]))
        if prev is None:
            print(f"gpu_check.py: cannot resume: {why}", file=sys.stderr)
            return 2
        if argv[0] == "--unfinished":
            print("\n".join(f for f in map(selection_file, unfinished(prev)) if f))
        return 0
    if len(argv) < 2:
        print("usage: gpu_check.py OUT_DIR WALL_SECONDS [--write PATH ...] [--resumed-from RUN_DIR]\n"
              "       gpu_check.py --can-resume RUN_DIR | --unfinished RUN_DIR", file=sys.stderr)
        return 2
    out, wall = pathlib.Path(argv[0]), float(argv[1])
    paths = [argv[i + 1] for i, a in enumerate(argv) if a == "--write" and i + 1 < len(argv)]
    resumed = None
    if "--resumed-from" in argv:
        resumed, why = resumable(pathlib.Path(argv[argv.index("--resumed-from") + 1]))
        if resumed is None:
            print(f"gpu_check.py: cannot resume: {why}", file=sys.stderr)
            return 2
    doc = record(out, wall, resumed)
    text = json.dumps(doc, indent=1) + "\n"
    for p in paths:
        pathlib.Path(p).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(p).write_text(text)
    for name, f in doc["files"].items():
        if f["failed"] or f["error"]:
            print(f"  {name}: {f['failed']} failed, {f['error']} errors, {f['passed']} passed")
    for name, s in doc["selections"].items():
        if s["rc"] != 0 or "note" in s:
            print(f"  pytest {name}: rc={s['rc']}" + (f" ({s['note']})" if "note" in s else ""))
    n = {k: sum(f[k] for f in doc["files"].values()) for k in ("passed", "failed", "skipped", "error")}
    c = doc["certify"]
    cs = "" if c is None else (f"; certify rc={c['rc']}" + (f", {c['ops_certified']}/{c['ops_total']} ops certified, "
                                                             f"{c['mutants_killed']}/{c['mutants_total']} mutants killed"
                                                             if "ops_total" in c else ""))
    print(f"gpu-check: {'GREEN' if doc['green'] else 'NOT GREEN'} on {doc['device']}: {len(doc['files'])} files, "
          f"{n['passed']} passed, {n['failed']} failed, {n['error']} errors, {n['skipped']} skipped{cs}; "
          f"{doc['wall_seconds']} s; digest {doc['digest'][:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
