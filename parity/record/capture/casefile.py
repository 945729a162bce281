"""The cases file ``parity capture`` writes and ``parity certify --cases`` replays (docs/cli.md).

The container of ``parity.files`` (a safetensors file, validated as the library validates it, whose
metadata key ``"kimi-parity"`` holds the JSON header, ``parity/schemas/cases.schema.json``): the run
(checkpoint, dtype, device, prompt ids, decode steps, store limit, seed, the model calls left
uncaptured) and one entry per case: op, call site, first phase, calls it stands for, kind
(``captured``: every input stored; ``regenerated``: some regenerated from statistics), the case
digest, the scalar kwargs, and per input its dtype, shape, SHA-256 and either its stored values
(tensor ``<id>.<input>``) or its seed, channel count and statistics (``<id>.<input>.<stat>``,
float64). Everything is checked on read, before any run: the header (strict JSON, schema, known
ops and their input names), each tensor's presence, dtype and shape, every stored input's SHA-256,
the statistics' sanity, and each case's digest. Any problem is one :class:`CasesError` line.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from kimi.validate import label
from parity import files, ops
from parity.errors import InputError

from . import tensors as T

FORMAT = "kimi-parity/cases"
VERSION = 1
METADATA_KEY = files.METADATA_KEY
MAX_FILE_BYTES = 8 << 30     # stored inputs are at most --store-limit bytes each
MAX_CASES = 10_000
MAX_NDIM = 8
MAX_ELEMENTS = 1 << 31       # a regenerated input is materialized in float64: 16 GiB at most
ID = re.compile(r"c[0-9]{1,6}")
SHA = re.compile(r"[0-9a-f]{64}")


class CasesError(InputError):
    """A cases file that cannot be used (one line naming the file)."""


CASES = files.Format(FORMAT, VERSION, schema="cases", noun="cases file", error=CasesError)


# -- writing -----------------------------------------------------------------------------------
def case_digest(op: str, kwargs: dict, inputs: dict) -> str:
    """SHA-256 of a case's identity: op, kwargs and each input's dtype, shape and SHA-256."""
    ident = {"op": op, "kwargs": kwargs,
             "inputs": {n: None if i is None else [i["dtype"], list(i["shape"]), i["sha256"]]
                        for n, i in inputs.items()}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _entry(cid: str, c) -> tuple[dict, dict]:
    inputs, payload = {}, {}
    for name, f in c.inputs.items():
        if f is None:
            inputs[name] = None
            continue
        spec = {"dtype": f.dtype, "shape": list(f.shape), "sha256": f.sha256, "stored": f.stored}
        if f.stored:
            payload[f"{cid}.{name}"] = f.values
        else:
            spec.update(seed=f.seed, channels=f.channels)
            payload.update({f"{cid}.{name}.{k}": torch.from_numpy(np.array(v, dtype=np.float64, order="C"))
                            for k, v in f.stats.items()})
        spec.update(c.extra.get(name, {}))
        inputs[name] = spec
    kind = "captured" if all(f is None or f.stored for f in c.inputs.values()) else "regenerated"
    entry = {"id": cid, "op": c.op, "call_site": c.call_site, "first": c.first, "calls": c.calls,
             "note": c.note, "kind": kind, "sha256": case_digest(c.op, c.kwargs, inputs),
             "kwargs": dict(c.kwargs), "inputs": inputs}
    return entry, payload


def write(path, captured: list, *, run: dict) -> Path:
    """Write ``captured`` (``parity.record.capture.recorder.Captured``, in order) to ``path`` atomically;
    ``run``: the header's run fields (checkpoint, dtype, device, prompt_ids, steps, store_limit,
    seed, uncaptured)."""
    entries, payload = [], {}
    for i, c in enumerate(captured):
        entry, data = _entry(f"c{i}", c)
        entries.append(entry)
        payload.update(data)
    return files.write(path, CASES, {**run, "cases": entries}, payload)


# -- reading -----------------------------------------------------------------------------------
@dataclass
class FileCase:
    """One validated case of a file: its header entry and its tensors (name -> CPU tensor)."""

    entry: dict
    tensors: dict = field(default_factory=dict)

    @property
    def op(self) -> str:
        return self.entry["op"]

    @property
    def id(self) -> str:
        return self.entry["id"]

    @property
    def kind(self) -> str:
        return self.entry["kind"]

    def label(self) -> str:
        shapes = " ".join(f"{n}={'x'.join(map(str, i['shape'])) or 'scalar'}"
                          for n, i in self.entry["inputs"].items() if i is not None)
        return f"{self.id} {self.kind} {shapes}"

    def arrays(self) -> dict:
        """float64 (integer inputs: int64) NumPy arrays by input name; None for an absent one."""
        out = {}
        for name, spec in self.entry["inputs"].items():
            if spec is None:
                out[name] = None
            elif spec["stored"]:
                t = self.tensors[f"{self.id}.{name}"]
                out[name] = t.to(torch.int64 if T.is_int(spec["dtype"]) else torch.float64).numpy()
            else:
                stats = {k: self.tensors[f"{self.id}.{name}.{k}"].numpy() for k in T.STATS}
                out[name] = T.regenerate(spec["shape"], spec["dtype"], stats, spec["seed"])
        return out


@dataclass
class CaseFile:
    path: Path
    sha256: str                 # of the whole file
    header: dict
    cases: list                 # FileCase, in file order

    def describe(self) -> dict:
        return {"file": str(self.path), "sha256": self.sha256, "cases": len(self.cases),
                "checkpoint": self.header["checkpoint"].get("describe", ""), "dtype": self.header["dtype"]}


def _fail(path, msg: str):
    raise CasesError(f"{path}: {msg}")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def read(path, records: dict | None = None) -> CaseFile:
    """Read and validate a cases file (module docstring); ``records``: op name -> OpRecord (default:
    every registered op). :class:`CasesError` for anything unusable."""
    path = Path(path)
    if not path.is_file():
        _fail(path, "no such cases file" if not path.exists() else "not a regular file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        _fail(path, f"{size} bytes, more than the limit of {MAX_FILE_BYTES}")
    header = files.read_header(path, CASES)
    head = header.head
    if len(head["cases"]) > MAX_CASES:
        _fail(path, f"{len(head['cases'])} cases, more than the limit of {MAX_CASES}")
    if records is None:
        records = {r.name: r for r in ops.records()}
    need = _check_entries(path, head["cases"], records, header.tensors)
    loaded = _load(path, need)
    cases = []
    for entry in head["cases"]:
        fc = FileCase(entry, {n: loaded[n] for n in need if n.split(".", 1)[0] == entry["id"]})
        _check_values(path, fc)
        cases.append(fc)
    return CaseFile(path, _file_digest(path), head, cases)


def _check_entries(path, entries, records, infos) -> dict:
    """Header entries against the registry and the safetensors tensors; returns {tensor: info}."""
    need, seen = {}, set()
    for entry in entries:
        cid = entry["id"]
        if not ID.fullmatch(cid) or cid in seen:
            _fail(path, f"case id '{label(cid)}': expected c<N>, each once")
        seen.add(cid)
        where = f"case {cid}"
        rec = records.get(entry["op"])
        if rec is None:
            _fail(path, f"{where}: unknown op '{label(entry['op'])}' (registered: parity certify --help, docs/certificates.md)")
        if not SHA.fullmatch(entry["sha256"]):
            _fail(path, f"{where}: sha256: expected 64 lowercase hex digits")
        names = set(entry["inputs"])
        want = set(rec.args) | set(rec.kwarg_arrays)
        if names != want:
            odd = sorted(names ^ want)[0]
            _fail(path, f"{where}: {entry['op']} takes inputs {', '.join(rec.args + rec.kwarg_arrays)}; "
                        f"'{label(odd)}' is {'missing' if odd in want else 'not one of them'}")
        for name, spec in entry["inputs"].items():
            if spec is None:
                if name in rec.args:
                    _fail(path, f"{where}: input {name} is required by {entry['op']}, got null")
                continue
            need.update(_check_input(path, f"{where}: input {name}", f"{cid}.{name}", spec, infos))
        stored = all(s is None or s["stored"] for s in entry["inputs"].values())
        if entry["kind"] != ("captured" if stored else "regenerated"):
            _fail(path, f"{where}: kind {entry['kind']!r} does not match its inputs")
        for k, v in entry["kwargs"].items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", k):
                _fail(path, f"{where}: kwarg '{label(k)}' is not a parameter name")
    extra = sorted(set(infos) - set(need))
    if extra:
        _fail(path, f"tensor '{label(extra[0])}' belongs to no case input")
    return need


def _check_input(path, where, base, spec, infos) -> dict:
    shape = spec["shape"]
    if len(shape) > MAX_NDIM:
        _fail(path, f"{where}: {len(shape)} dims, more than {MAX_NDIM}")
    if math.prod(shape) > MAX_ELEMENTS:
        _fail(path, f"{where}: {math.prod(shape)} elements, more than the limit of {MAX_ELEMENTS}")
    if not SHA.fullmatch(spec["sha256"]):
        _fail(path, f"{where}: sha256: expected 64 lowercase hex digits")
    if spec["stored"]:
        if "seed" in spec or "channels" in spec:
            _fail(path, f"{where}: a stored input has no seed or channels")
        want = {base: (T.SAFETENSORS[spec["dtype"]], tuple(shape))}
    else:
        if T.is_int(spec["dtype"]):
            _fail(path, f"{where}: integer inputs are stored exactly, never regenerated")
        if "seed" not in spec or "channels" not in spec or spec["seed"] >= 2 ** 32 \
                or spec["channels"] > len(shape):
            _fail(path, f"{where}: a regenerated input needs a 32-bit seed and channels <= its {len(shape)} dims")
        cshape = tuple(shape[len(shape) - spec["channels"]:])
        want = {f"{base}.{k}": ("F64", cshape) for k in T.STATS}
    for name, (dtype, shp) in want.items():
        info = infos.get(name)
        if info is None:
            _fail(path, f"{where}: no tensor '{name}'")
        if info.dtype != dtype or info.shape != shp:
            _fail(path, f"{where}: tensor '{name}' is {info.dtype} {list(info.shape)}, expected {dtype} {list(shp)}")
    return want


def _load(path, names) -> dict:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {n: f.get_tensor(n) for n in names}
    except (SafetensorError, OSError) as exc:
        raise CasesError(f"{path}: cannot read its tensors ({' '.join(str(exc).split())})") from None


def _check_values(path, fc: FileCase) -> None:
    where = f"case {fc.id}"
    for name, spec in fc.entry["inputs"].items():
        if spec is None:
            continue
        if spec["stored"]:
            t = fc.tensors[f"{fc.id}.{name}"]
            if T.digest(t) != spec["sha256"]:
                _fail(path, f"{where}: input {name}: its values do not match their sha256 (changed after capture)")
            if not T.is_int(spec["dtype"]) and not bool(torch.isfinite(t).all()):
                _fail(path, f"{where}: input {name}: non-finite values")
            continue
        s = {k: fc.tensors[f"{fc.id}.{name}.{k}"] for k in T.STATS}
        if not all(bool(torch.isfinite(v).all()) for v in s.values()):
            _fail(path, f"{where}: input {name}: non-finite statistics")
        if bool((s["std"] < 0).any()) or bool((s["min"] > s["max"]).any()):
            _fail(path, f"{where}: input {name}: statistics with std < 0 or min > max")
    if case_digest(fc.op, fc.entry["kwargs"], fc.entry["inputs"]) != fc.entry["sha256"]:
        _fail(path, f"{where}: its sha256 does not match its op, kwargs and inputs (changed after capture)")
