"""Weight sources: hub-layout safetensors checkpoints, read lazily without torch, and a writer.

A ``WeightSource`` has ``config`` (``KimiConfig``), ``names()``, ``shape(name)``,
``storage_dtype(name)`` (``"bfloat16" | "float16" | "float32"``), ``get(name)`` (float64, validated:
shape, finite), ``get_raw(name)`` (the storage bits: ``uint16`` for bf16, ``float16``, ``float32``),
``get_rows(name, rows)`` (float64 rows along the first axis, so a 163840-row embedding or lm_head is
never converted whole) and ``describe()``. Shapes are the canonical ones of ``expected_tensors``:
a conv weight stored as ``[C, W]`` is returned as ``[C, 1, W]``.

The safetensors format is read here directly (NumPy cannot represent bf16 and the reference never
imports torch): an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the raw
little-endian bytes, offsets relative to the end of the header. Each file is ``np.memmap``-ed on
first use and tensors are sliced out one at a time.

Every problem with a checkpoint raises ``CheckpointError`` (a ``ValueError``) with a one-line message
naming the file, the tensor and what was expected; a broken ``config.json`` raises
``CheckpointConfigError``, which is both a ``CheckpointError`` and the config's ``ConfigError``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np

from .config import ConfigError, KimiConfig
from .executor import bf16_bits_to_float64  # noqa: F401  (the exact, multi-threaded conversion)
from .executor import all_finite, to_numpy
from .tensors import alternative_shapes, expected_tensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

# safetensors dtype code <-> storage dtype names of the WeightSource API (the ones the model reads)
DTYPE_CODES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
CODE_OF = {v: k for k, v in DTYPE_CODES.items()}
RAW_NUMPY = {"bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
# every dtype of the format, for offset checks of tensors the model does not read
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
            "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model its config describes (one-line message)."""


class CheckpointConfigError(CheckpointError, ConfigError):
    """The checkpoint's config.json is missing a key or describes no valid model."""


class CheckpointWarning(UserWarning):
    """Something in a checkpoint is ignored (unknown extra tensors)."""


# -- bf16 <-> float ----------------------------------------------------------------------------------

def _float64_to_float32_round_to_odd(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 bits rounded toward zero with the last bit forced to 1 when inexact.

    Rounding to odd into a format with >= p+2 bits and then to nearest-even gives the correctly
    rounded result, so float64 -> (odd) float32 -> bf16 rounds once, not twice."""
    with np.errstate(over="ignore", invalid="ignore"):
        t = x.astype(np.float32)
        back = t.astype(np.float64)
    finite = np.isfinite(x)
    inexact = finite & (back != x)
    t = np.where(inexact & (np.abs(back) > np.abs(x)), np.nextafter(t, np.float32(0)), t)
    return t.view(np.uint32) | inexact.astype(np.uint32)


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float16/32/64 values to bf16 (round to nearest, ties to even; correctly rounded from
    float64 too); returns the ``uint16`` bit patterns. NaN stays NaN, overflow goes to +-inf."""
    x = np.asarray(x)
    if x.dtype == np.float64:
        u = _float64_to_float32_round_to_odd(x)
    elif x.dtype in (np.float32, np.float16):
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    else:
        raise TypeError(f"cannot round {x.dtype} to bfloat16")
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (u >> 16) | np.uint32(0x40), rounded).astype(np.uint16)


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values -> storage bits of ``dtype`` (``uint16`` for bf16). An array that already holds the
    storage representation (``uint16`` for bf16, ``float16``, ``float32``) is kept as it is."""
    x = np.asarray(x)
    if dtype not in RAW_NUMPY:
        raise ValueError(f"unsupported storage dtype {dtype!r}; expected one of {sorted(RAW_NUMPY)}")
    if x.dtype == RAW_NUMPY[dtype]:
        return x
    if dtype == "bfloat16":
        return float_to_bf16_bits(x)
    if x.dtype.kind != "f":
        raise TypeError(f"cannot store {x.dtype} values as {dtype}")
    with np.errstate(over="ignore"):
        return x.astype(RAW_NUMPY[dtype])  # numpy rounds float64 -> float16/32 correctly


def raw_to_float64(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Storage bits -> float64 (exact)."""
    if dtype == "bfloat16":
        return bf16_bits_to_float64(raw)
    return np.asarray(raw).astype(np.float64)


# -- the source API ----------------------------------------------------------------------------------

class WeightSource:
    """Base of checkpoint and synthetic sources; subclasses implement ``names``, ``shape``,
    ``storage_dtype``, ``get_raw`` and ``describe`` (and may override ``get_rows``)."""

    config: KimiConfig

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def storage_dtype(self, name: str) -> str:
        raise NotImplementedError

    def get_raw(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def _where(self, name: str) -> str:
        return self.describe()

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

    def get(self, name: str) -> np.ndarray:
        """``name`` as float64 in its canonical shape; ``CheckpointError`` if a value is not finite."""
        values = raw_to_float64(self.get_raw(name), self.storage_dtype(name))
        return self._check_finite(name, values)

    def get_rows(self, name: str, rows) -> np.ndarray:
        """Rows ``rows`` (1-D integer indices) of ``name`` along its first axis, float64."""
        return self._check_finite(name, self.get(name)[np.asarray(rows, dtype=np.int64)])

    def get_raw_rows(self, name: str, rows) -> np.ndarray:
        """The storage bits of rows ``rows`` of ``name`` (see ``get_raw``)."""
        return self.get_raw(name)[np.asarray(rows, dtype=np.int64)]

    # -- on an executor (reference.executor): float64 where the model runs --------------------------
    def get_on(self, name: str, executor, *, pending: list | None = None):
        """``name`` as float64 on ``executor``, validated like ``get``. The bits are read on the
        host and converted on the device (a GPU copies 2 bytes per bf16 weight, not 8). With
        ``pending`` (a list) the finiteness check is queued there (``check_pending``) instead of
        synchronizing with the device now."""
        if executor.name == "numpy":
            return self.get(name)
        values = executor.from_storage(self.get_raw(name), self.storage_dtype(name))
        return self.check_finite_on(name, values, executor, pending=pending)

    def get_rows_on(self, name: str, rows, executor, *, pending: list | None = None):
        """``get_rows`` on ``executor``."""
        if executor.name == "numpy":
            return self.get_rows(name, rows)
        raw = self.get_raw_rows(name, rows)
        values = executor.from_storage(raw, self.storage_dtype(name))
        return self.check_finite_on(name, values, executor, pending=pending)

    def check_finite_on(self, name: str, values, executor, *, pending: list | None = None):
        """``values`` if all finite (one reduction on the device), else ``CheckpointError``; with
        ``pending``, the reduction is queued as ``(name, sum)`` and checked by ``check_pending``."""
        total = executor.xp.sum(values)
        if pending is not None:
            pending.append((name, total))
            return values
        if math.isfinite(float(total)):
            return values
        return self._check_finite(name, to_numpy(values))

    def check_pending(self, pending: list, executor) -> None:
        """Check the queued sums of ``check_finite_on(..., pending=)`` in one synchronization; the
        first non-finite tensor raises ``CheckpointError`` naming it (read again for the detail)."""
        if not pending:
            return
        xp = executor.xp
        finite = to_numpy(xp.isfinite(xp.stack([t for _, t in pending])))
        names = [n for n, _ in pending]
        pending.clear()
        for name, ok in zip(names, finite.tolist()):
            if not ok:
                self.check_finite_on(name, executor.from_storage(self.get_raw(name), self.storage_dtype(name)),
                                     executor)
                raise CheckpointError(f"{self._where(name)}: {name}: non-finite values; expected finite weights")

    def _check_finite(self, name: str, values: np.ndarray) -> np.ndarray:
        # values come from bf16/f16/f32 (|x| < 3.5e38), so their float64 sum cannot overflow: it is
        # finite exactly when every value is. One pass on every core, no temporary; locate the
        # culprit only on failure.
        if all_finite(values):
            return values
        bad = ~np.isfinite(values)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise CheckpointError(f"{self._where(name)}: {name}: {int(bad.sum())} non-finite values "
                                  f"(first at index {first}: {values[first]}); expected finite weights")
        return values


class _Entry:
    __slots__ = ("file", "code", "stored_shape", "shape", "begin", "end")

    def __init__(self, file, code, stored_shape, shape, begin, end):
        self.file, self.code, self.stored_shape, self.shape = file, code, stored_shape, shape
        self.begin, self.end = begin, end


def read_header(path: Path) -> tuple[int, dict, dict]:
    """(data start, {name: info}, metadata) of a safetensors file, validated against its size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated file ({size} bytes; a safetensors file "
                                      "starts with an 8-byte header length)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: header length {n} runs past the end of the file "
                                      f"({size} bytes): truncated or not a safetensors file")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data_start, data_size = 8 + n, size - 8 - n
    for name, info in header.items():
        where = f"{path}: {name}"
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
                and isinstance(info.get("shape"), list) and isinstance(info.get("data_offsets"), list)):
            raise CheckpointError(f"{where}: header entry needs dtype, shape and data_offsets, got {info!r}")
        code, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if code not in ITEMSIZE:
            raise CheckpointError(f"{where}: unknown dtype {code!r}")
        if not all(isinstance(s, int) and s >= 0 for s in shape) or not (
                len(offs) == 2 and all(isinstance(o, int) for o in offs) and 0 <= offs[0] <= offs[1]):
            raise CheckpointError(f"{where}: malformed shape {shape!r} or data_offsets {offs!r}")
        nbytes = math.prod(shape) * ITEMSIZE[code]
        if offs[1] - offs[0] != nbytes:
            raise CheckpointError(f"{where}: data_offsets {offs} span {offs[1] - offs[0]} bytes, "
                                  f"expected {nbytes} for {code} {tuple(shape)}")
        if offs[1] > data_size:
            raise CheckpointError(f"{where}: data_offsets {offs} run past the end of the data "
                                  f"({data_size} bytes): truncated file")
    return data_start, header, meta


class SafetensorsSource(WeightSource):
    """A hub-layout checkpoint directory, read lazily tensor by tensor (see ``open_source``)."""

    def __init__(self, path: Path, config: KimiConfig, entries: dict[str, _Entry],
                 data_start: dict[Path, int]):
        self.path, self.config = path, config
        self._entries, self._data_start = entries, data_start
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{name}: no such tensor in {self.path}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def storage_dtype(self, name: str) -> str:
        e = self._entry(name)
        if e.code not in DTYPE_CODES:
            raise CheckpointError(f"{e.file}: {name}: unsupported dtype {e.code}; "
                                  f"expected one of {', '.join(DTYPE_CODES)}")
        return DTYPE_CODES[e.code]

    def files(self) -> list[Path]:
        return sorted(self._data_start)

    def describe(self) -> str:
        return f"checkpoint {self.path} ({len(self._data_start)} file(s), {len(self._entries)} tensors)"

    def _where(self, name: str) -> str:
        return str(self._entries[name].file) if name in self._entries else str(self.path)

    def _view(self, name: str) -> np.ndarray:
        """The stored bytes of ``name`` as an (unaligned, read-only) array in its canonical shape."""
        e = self._entry(name)
        dtype = self.storage_dtype(name)
        mm = self._maps.get(e.file)
        if mm is None:
            mm = self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        if mm.size < self._data_start[e.file] + e.end:  # the file shrank since it was opened
            raise CheckpointError(f"{e.file}: {name}: data_offsets run past the end of the file: truncated")
        count = math.prod(e.stored_shape)
        arr = np.frombuffer(mm, dtype=RAW_NUMPY[dtype], count=count,
                            offset=self._data_start[e.file] + e.begin)
        return arr.reshape(e.shape)

    def get_raw(self, name: str) -> np.ndarray:
        return np.array(self._view(name))

    def get(self, name: str) -> np.ndarray:
        # converted straight from the memmap: no intermediate copy of the raw bytes
        return self._check_finite(name, raw_to_float64(self._view(name), self.storage_dtype(name)))

    def get_rows(self, name: str, rows) -> np.ndarray:
        raw = self.get_raw_rows(name, rows)
        return self._check_finite(name, raw_to_float64(raw, self.storage_dtype(name)))

    def get_raw_rows(self, name: str, rows) -> np.ndarray:
        return self._view(name)[np.asarray(rows, dtype=np.int64)]


def open_source(path: str | os.PathLike) -> SafetensorsSource:
    """Open a checkpoint directory (``config.json`` + ``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``). Headers are read and validated now (every expected tensor
    present with its shape and a supported dtype, offsets inside the files); values are read on
    ``get`` (and checked finite there). Unknown extra tensors give a ``CheckpointWarning``."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    cfg_path = root / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: not found (a checkpoint directory needs config.json)")
    try:
        config = KimiConfig.from_json(cfg_path)
    except ConfigError as exc:
        raise CheckpointConfigError(str(exc)) from None

    single, index = root / SINGLE_FILE, root / INDEX_FILE
    if single.is_file():
        files = [single]
        weight_map = None
    elif index.is_file():
        weight_map = _read_index(index)
        files = []
        for shard in dict.fromkeys(weight_map.values()):
            f = root / shard
            if not f.is_file():
                example = next(n for n, s in weight_map.items() if s == shard)
                raise CheckpointError(f"{index}: shard {shard!r} (holding {example}) does not exist")
            files.append(f)
    else:
        raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}")

    expected = expected_tensors(config)
    entries: dict[str, _Entry] = {}
    data_start: dict[Path, int] = {}
    for f in files:
        start, header, _ = read_header(f)
        data_start[f] = start
        for name, info in header.items():
            if weight_map is not None and weight_map.get(name, f.name) != f.name:
                continue  # the index places it elsewhere; that shard's copy is the one read
            if name in entries:
                raise CheckpointError(f"{f}: {name}: also stored in {entries[name].file}")
            stored = tuple(info["shape"])
            shape = stored
            if name in expected:
                want = expected[name]
                if stored != want and stored not in alternative_shapes(name, want):
                    alts = "".join(f" or {a}" for a in alternative_shapes(name, want))
                    raise CheckpointError(f"{f}: {name}: expected shape {want}{alts}, got {stored}")
                if info["dtype"] not in DTYPE_CODES:
                    raise CheckpointError(f"{f}: {name}: unsupported dtype {info['dtype']}; "
                                          f"expected one of {', '.join(DTYPE_CODES)}")
                shape = want
            entries[name] = _Entry(f, info["dtype"], stored, shape, *info["data_offsets"])
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in entries:
                raise CheckpointError(f"{index}: {name} is mapped to {shard}, which does not contain it")

    missing = [n for n in expected if n not in entries]
    if missing:
        where = files[0] if weight_map is None else index
        raise CheckpointError(f"{where}: missing tensor {missing[0]} (expected shape {expected[missing[0]]})"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    extra = [n for n in entries if n not in expected]
    if extra:
        shown = ", ".join(extra[:5]) + (f", ... ({len(extra)} in all)" if len(extra) > 5 else "")
        warnings.warn(f"{root}: ignoring {len(extra)} unexpected tensor(s): {shown}",
                      CheckpointWarning, stacklevel=2)
    return SafetensorsSource(root, config, entries, data_start)


def _read_index(index: Path) -> dict[str, str]:
    try:
        d = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index}: not valid JSON ({exc})") from None
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index}: expected an object with a 'weight_map' of tensor -> shard file")
    for name, shard in wm.items():
        if Path(shard).name != shard:
            raise CheckpointError(f"{index}: {name}: shard {shard!r} must be a file name in the directory")
    return wm


# -- the writer ---------------------------------------------------------------------------------------

def plan_shards(sizes: Iterable[int], shard_max_bytes: int | None) -> list[int]:
    """The shard index of each tensor (in order) under the writer's greedy rule: a new shard starts
    when the current one is non-empty and the next tensor would take it past ``shard_max_bytes``."""
    out, shard, used = [], 0, 0
    for size in sizes:
        if shard_max_bytes is not None and used and used + size > shard_max_bytes:
            shard, used = shard + 1, 0
        out.append(shard)
        used += size
    return out


def _shard_name(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


class _ShardWriter:
    """Spools one shard's tensors (4-byte dtypes first, so every tensor stays aligned) then writes
    header + data."""

    def __init__(self, tmp: Path, k: int):
        self.path = tmp / f".shard-{k}"
        self.spools = {4: open(tmp / f".spool-{k}-4", "w+b"), 2: open(tmp / f".spool-{k}-2", "w+b")}
        self.items: list[tuple[str, str, tuple, int, int]] = []  # name, code, shape, width, offset
        self.nbytes = 0

    def add(self, name: str, raw: np.ndarray, dtype: str) -> None:
        width = raw.dtype.itemsize
        spool = self.spools[width]
        offset = spool.tell()
        spool.write(np.ascontiguousarray(raw, dtype=RAW_NUMPY[dtype]).tobytes())
        self.items.append((name, CODE_OF[dtype], tuple(raw.shape), width, offset))
        self.nbytes += raw.nbytes

    def close(self) -> None:
        base4 = self.spools[4].tell()
        header: dict = {"__metadata__": {"format": "pt"}}
        for name, code, shape, width, offset in self.items:
            begin = offset + (0 if width == 4 else base4)
            header[name] = {"dtype": code, "shape": list(shape),
                            "data_offsets": [begin, begin + math.prod(shape) * width]}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the safetensors library writes
        with open(self.path, "wb") as out:
            out.write(len(text).to_bytes(8, "little"))
            out.write(text)
            for width in (4, 2):
                spool = self.spools[width]
                spool.seek(0)
                shutil.copyfileobj(spool, out, 1 << 24)
                spool.close()
                os.unlink(spool.name)


def save_checkpoint(directory: str | os.PathLike, config: KimiConfig, tensors: Mapping[str, np.ndarray],
                    *, dtypes: Mapping[str, str] | Callable[[str], str],
                    shard_max_bytes: int | None = None, overwrite: bool = False) -> Path:
    """Write ``config.json`` and ``tensors`` as a hub-layout checkpoint in ``directory``.

    ``tensors`` maps name -> values (any float array, or the storage bits: ``uint16`` for bf16); it
    is read once per name in its iteration order, so a lazy mapping keeps one tensor in memory.
    ``dtypes`` gives each name's storage dtype (mapping or function); floats are rounded to it
    (bf16: round to nearest even). With ``shard_max_bytes`` the tensors are split greedily in order
    (``plan_shards``) into ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``;
    a single shard is written as ``model.safetensors``. Everything is written into a temporary
    sibling directory that is renamed into place at the end, so a failure leaves nothing
    half-written. An existing non-empty ``directory`` is replaced only with ``overwrite=True``."""
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"{target}: directory is not empty (pass overwrite=True to replace it)")
    dtype_of = dtypes if callable(dtypes) else dtypes.__getitem__
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the checkpoint is an ordinary directory
    try:
        shards: list[_ShardWriter] = []
        current: _ShardWriter | None = None
        where: dict[str, int] = {}
        total = 0
        for name in tensors:
            dtype = dtype_of(name)
            raw = to_storage(tensors[name], dtype)
            if current is not None and plan_shards([current.nbytes, raw.nbytes], shard_max_bytes)[1]:
                current.close()
                current = None
            if current is None:
                current = _ShardWriter(tmp, len(shards))
                shards.append(current)
            current.add(name, raw, dtype)
            where[name] = len(shards) - 1
            total += raw.nbytes
        if current is None:
            raise ValueError("save_checkpoint: no tensors to write")
        current.close()
        n = len(shards)
        if n == 1:
            os.rename(shards[0].path, tmp / SINGLE_FILE)
        else:
            for k, s in enumerate(shards):
                os.rename(s.path, tmp / _shard_name(k, n))
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: _shard_name(k, n) for name, k in where.items()}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config.to_json(tmp / CONFIG_FILE)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _replace_dir(tmp: Path, target: Path) -> None:
    if target.is_dir():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / "d")
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old / "d", target)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
