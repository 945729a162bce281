"""The calls file ``parity watch`` writes and ``parity judge`` judges (docs/watch.md).

The container of ``parity.files`` (a safetensors file whose metadata key ``"kimi-parity"`` holds
the JSON header, ``parity/schemas/calls.schema.json``): the run (command, targets, byte budget, processes) and one
entry per call, in each process's call order: id, process, index, step, the watched name and
target, the op its adapter mapped it to (or the one-line reason none did), the call site, whether
its tensors were kept (else why not: the budget, shapes only), its scalar kwargs and per input and
output its dtype and shape. A kept call's tensors are ``<id>.in.<name>`` and ``<id>.out.<name>``.
``dropped`` counts the calls not kept, by op and reason. ``run.never_called`` names each target no
process called, and why it likely was not (``uncalled``; absent in files written before it was
recorded: the judge then finds those targets from ``run.targets``).

While a program runs, each process writes its calls as parts, one safetensors file per flush in
``<FILE>.parts/`` (each part written whole, then renamed: a crash leaves whole parts only);
:func:`merge` joins the parts into ``<FILE>`` atomically and removes them. A program killed before
the merge leaves its parts, which ``merge`` (``parity watch --merge FILE``) joins later.
"""
from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from parity import files
from parity.errors import InputError

FORMAT = "kimi-parity/calls"
VERSION = 1
METADATA_KEY = files.METADATA_KEY
# Written whole and renamed into place (a crash of the program leaves the parts so far, each whole),
# but not forced to the disk: a record of this run, which a crash of the machine ends anyway, and
# an fsync would cost a watch block around a 10 ms prefill several percent of it.
DURABLE = False
PART = re.compile(r"p([0-9]{1,10})-([0-9]{1,8})\.safetensors")
ID = re.compile(r"p[0-9]{1,10}c[0-9]{1,10}")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
SAFETENSORS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
               "int32": "I32", "int64": "I64", "bool": "BOOL"}


class CallsError(InputError):
    """A calls file that cannot be used (one line naming the file)."""


CALLS = files.Format(FORMAT, VERSION, schema="calls", noun="calls file", error=CallsError)


_NAMES = {d: n for n, d in DTYPES.items()}


def dtype_name(t: torch.Tensor) -> str:
    name = _NAMES.get(t.dtype)
    return name if name is not None else str(t.dtype).replace("torch.", "")


def parts_dir(path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".parts")


def write_part(path, pid: int, seq: int, run: dict, entries: list, tensors: dict, *,
               never_called: dict | None = None) -> Path:
    """One flush of one process: ``entries`` and the kept ``tensors`` (name -> CPU tensor), written
    whole under a temporary name, then renamed; ``never_called`` (a process's last part): target
    spec -> why this process never called it."""
    d = parts_dir(path)
    d.mkdir(parents=True, exist_ok=True)
    fields = {"part": True, "run": run, "calls": entries}
    if never_called:
        fields["never_called"] = never_called
    return files.write(d / f"p{pid}-{seq}.safetensors", CALLS, fields,
                       {k: v.contiguous() for k, v in tensors.items()}, durable=DURABLE)


@dataclass
class Held:
    """A process's calls still in memory when it writes the file itself (``parity.watch``): merged
    after its parts, as its last part would be."""

    pid: int
    calls: list
    tensors: dict
    never_called: dict = field(default_factory=dict)


def merge(path, run: dict | None = None, *, empty: bool = False, held: Held | None = None) -> Path | None:
    """Join the parts of ``path`` (every process's flushes, in process and flush order) and then
    ``held`` into ``path``, atomically, and remove the parts; the run fields of the first part,
    updated with ``run``. No parts and nothing held: a file without calls when ``empty`` (the run
    fields from ``run``), else None."""
    d = parts_dir(path)
    parts = sorted((p for p in d.glob("p*.safetensors") if PART.fullmatch(p.name)),
                   key=lambda p: tuple(int(x) for x in PART.fullmatch(p.name).groups())) if d.is_dir() else []
    if not parts and not empty and held is None:
        return None
    entries, tensors, pids, head_run, reasons = [], {}, [], None, []
    for f in parts:
        head = files.read_header(f, CALLS, schema=False).head   # checked as a whole when the merged file is read
        head_run = head_run or head.get("run", {})
        entries += head["calls"]
        tensors.update(load_file(str(f)))
        pid = int(PART.fullmatch(f.name).group(1))
        if head["calls"] and pid not in pids:
            pids.append(pid)
        if isinstance(head.get("never_called"), dict):
            reasons.append((pid, head["never_called"]))
    if held is not None:
        entries += held.calls
        tensors.update({k: v.contiguous() for k, v in held.tensors.items()})   # a host copy keeps a view's strides
        if held.calls and held.pid not in pids:
            pids.append(held.pid)
        if held.never_called:
            reasons.append((held.pid, held.never_called))
    dropped = Counter()
    for e in entries:
        if not e["kept"]:
            dropped[(e["op"] or "unmapped", e["dropped"])] += 1
    out_run = {**(head_run or {}), **(run or {}), "processes": pids}
    out_run["never_called"] = never_called(out_run.get("targets") or {}, entries, reasons)
    files.write(path, CALLS, {"part": False, "run": out_run,
                              "dropped": [{"op": op, "reason": why, "calls": n} for (op, why), n in dropped.items()],
                              "calls": entries}, tensors, durable=DURABLE)
    for f in parts:
        f.unlink()
    try:
        d.rmdir()
    except OSError:
        pass
    return Path(path)


UNKNOWN_WHY = "not recorded (the file was written by a watch that did not name never-called targets)"
NO_REPORT = ("no watched process reported on it: the program started no Python process, or each was "
             "killed before it exited")


def never_called(targets: dict, entries: list, reasons: list) -> list:
    """``[{"watched", "target", "why"}]`` for each target (name -> spec) that no entry calls;
    ``reasons``: ``[(pid, {spec: why})]`` as the processes said (the distinct ones, joined)."""
    called = {e["target"] for e in entries}
    out = []
    for name, spec in targets.items():
        if spec in called:
            continue
        whys = []
        for pid, said in reasons:
            why = said.get(spec)
            if why and why not in whys:
                whys.append(why)
        out.append({"watched": name, "target": spec, "why": "; and elsewhere: ".join(whys) or NO_REPORT})
    return out


@dataclass
class CallFile:
    path: Path
    sha256: str
    header: dict
    calls: list          # header entries, in file order

    def tensors(self, entry: dict, side: str) -> dict:
        """name -> CPU tensor of a kept call's inputs (``side="in"``) or outputs (``"out"``)."""
        names = entry["inputs" if side == "in" else "outputs"]
        out = {}
        with safe_open(str(self.path), framework="pt") as f:
            for n, spec in names.items():
                out[n] = None if spec is None else f.get_tensor(f"{entry['id']}.{side}.{n}")
        return out


def read(path) -> CallFile:
    """Read and validate a calls file: the header, and every kept call's tensors present with the
    dtype and shape its entry says; :class:`CallsError` (one line) otherwise."""
    path = Path(path)
    if not path.is_file():
        if parts_dir(path).is_dir():
            raise CallsError(f"{path}: not merged yet; its parts are in {parts_dir(path)} "
                             f"(parity watch --merge {path})")
        raise CallsError(f"{path}: no such calls file" if not path.exists() else f"{path}: not a regular file")
    got = files.read_header(path, CALLS)
    head, infos = got.head, got.tensors
    need, seen = set(), set()
    for e in head["calls"]:
        if not ID.fullmatch(e["id"]) or e["id"] in seen:
            raise CallsError(f"{path}: call id {e['id']!r}: expected p<pid>c<index>, each once")
        seen.add(e["id"])
        if not e["kept"]:
            continue
        for side, key in (("in", "inputs"), ("out", "outputs")):
            for n, spec in e[key].items():
                if spec is None:
                    continue
                name = f"{e['id']}.{side}.{n}"
                info = infos.get(name)
                if info is None:
                    raise CallsError(f"{path}: call {e['id']}: no tensor {name!r}")
                if spec["dtype"] not in SAFETENSORS:
                    raise CallsError(f"{path}: call {e['id']}: {name!r} is {spec['dtype']}; the judge reads "
                                     f"{', '.join(SAFETENSORS)}")
                want = (SAFETENSORS[spec["dtype"]], tuple(spec["shape"]))
                if (info.dtype, tuple(info.shape)) != want:
                    raise CallsError(f"{path}: call {e['id']}: tensor {name!r} is {info.dtype} {list(info.shape)}, "
                                     f"expected {want[0]} {list(want[1])}")
                need.add(name)
    extra = sorted(set(infos) - need)
    if extra:
        raise CallsError(f"{path}: tensor {extra[0]!r} belongs to no kept call")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return CallFile(path, h.hexdigest(), head, head["calls"])
