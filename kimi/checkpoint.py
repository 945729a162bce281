"""Weight sources: hub-layout safetensors checkpoints, read lazily without torch, and a writer.

A ``WeightSource`` has ``config`` (``KimiConfig``), ``names()``, ``shape(name)``,
``storage_dtype(name)`` (``"bfloat16" | "float16" | "float32" | "float64"``), ``get(name)`` (float64,
validated: shape, finite), ``get_raw(name)`` (the storage bits: ``uint16`` for bf16, ``float16``,
``float32``, ``float64``),
``get_rows(name, rows)`` (float64 rows along the first axis, so a 163840-row embedding or lm_head is
never converted whole) and ``describe()``. Shapes are the canonical ones of ``expected_tensors``:
a conv weight stored as ``[C, W]`` is returned as ``[C, 1, W]``.

The safetensors format is read here directly (NumPy cannot represent bf16 and the reference never
imports torch); ``safetensors_format`` validates each header as the safetensors library does (the
tensors tile the data section exactly). Each file is ``np.memmap``-ed on first use and tensors are
sliced out one at a time.

Every problem with a checkpoint raises ``CheckpointError`` (a ``ValueError``) with a one-line message
naming the file, the tensor and what was expected, never the file's content; a broken
``config.json`` raises ``CheckpointConfigError``, which is both a ``CheckpointError`` and the
config's ``ConfigError``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np

from .config import MAX_TENSORS, ConfigError, KimiConfig
from .safetensors_format import Header
from .safetensors_format import read_header as read_st_header
from .storage import RAW_NUMPY, all_finite, raw_to_float64, to_storage
from .tensors import alternative_shapes, expected_tensors, layer_prefix, transformers_aliases
from .validate import InvalidInput, as_file_name, as_object, field, inside, label, read_json_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

# safetensors dtype code <-> storage dtype names of the WeightSource API (the ones the model reads;
# F64 is what transformers writes for a model held in float64, the reference's own precision)
DTYPE_CODES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
CODE_OF = {v: k for k, v in DTYPE_CODES.items()}
MAX_INDEX_BYTES = 64 << 20  # the 48B model's index (20,493 entries) is 1.9 MB


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model its config describes (one-line message)."""


class CheckpointConfigError(CheckpointError, ConfigError):
    """The checkpoint's config.json is missing a key or describes no valid model."""


class CheckpointWarning(UserWarning):
    """Something in a checkpoint is ignored (unknown extra tensors)."""


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

    def _label(self, name: str) -> str:
        return label(name)

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

    def get(self, name: str) -> np.ndarray:
        """``name`` as float64 in its canonical shape; ``CheckpointError`` if a value is not finite."""
        values = raw_to_float64(self.get_raw(name), self.storage_dtype(name))
        return self.check_finite(name, values)

    def get_rows(self, name: str, rows) -> np.ndarray:
        """Rows ``rows`` (1-D integer indices) of ``name`` along its first axis, float64."""
        return self.check_finite(name, self.get(name)[np.asarray(rows, dtype=np.int64)])

    def get_raw_rows(self, name: str, rows) -> np.ndarray:
        """The storage bits of rows ``rows`` of ``name`` (see ``get_raw``)."""
        return self.get_raw(name)[np.asarray(rows, dtype=np.int64)]

    def raw_parts(self, name: str):
        """The storage bits of ``name`` in consecutive parts along the first axis (one here; a
        source that makes them, the synthetic generator, yields a few rows at a time)."""
        yield self.get_raw(name)

    def nonfinite_error(self, name: str) -> CheckpointError:
        """The error of a weight found non-finite after the fact (a streamed product's block):
        ``get``'s, naming the first non-finite value, raised here; else a one-line error to raise."""
        self.get(name)  # raises CheckpointError naming the tensor and its first non-finite value
        return CheckpointError(f"{self._where(name)}: {self._label(name)}: non-finite values; "
                               "expected finite weights")

    def values_on(self, name: str, rows, xp, device):
        """None: ``name``'s values are its storage bits, read on the host (``get_raw``,
        ``get_raw_rows``) for the reader to move where it computes. A source that makes its values
        (the synthetic generator) returns them made by the array namespace ``xp`` on ``device``
        instead, float32 before storage rounding: ``[len(rows), *shape[1:]]`` (``rows``: 1-D host
        indices), or the whole tensor with ``rows`` None (``reference.weights.get_on`` uses it)."""
        return None

    def check_finite(self, name: str, values: np.ndarray) -> np.ndarray:
        """``values`` (float64 NumPy, of ``name``) if all finite, else ``CheckpointError`` naming the
        tensor, the count and the first non-finite value's index."""
        # a finite float64 sum means every value is finite (block sums on every core, no
        # temporary). An infinite sum of finite values (float64 storage can overflow it) is told
        # apart by the element check below.
        with np.errstate(over="ignore", invalid="ignore"):
            if all_finite(values):
                return values
        bad = ~np.isfinite(values)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise CheckpointError(f"{self._where(name)}: {self._label(name)}: {int(bad.sum())} non-finite values "
                                  f"(first at index {first}: {values[first]}); expected finite weights")
        return values


class _Entry:
    __slots__ = ("file", "stored_name", "code", "stored_shape", "shape", "begin", "end")

    def __init__(self, file, stored_name, code, stored_shape, shape, begin, end):
        self.file, self.stored_name, self.code = file, stored_name, code
        self.stored_shape, self.shape, self.begin, self.end = stored_shape, shape, begin, end


def read_header(path: Path) -> Header:
    """The validated header of one safetensors file (``safetensors_format.read_header``), with
    ``CheckpointError`` for a file the format refuses."""
    try:
        return read_st_header(path)
    except InvalidInput as exc:
        raise CheckpointError(str(exc)) from None


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
            raise CheckpointError(f"{e.file}: {label(e.stored_name)}: unsupported dtype {e.code}; "
                                  f"expected one of {', '.join(DTYPE_CODES)}")
        return DTYPE_CODES[e.code]

    def files(self) -> list[Path]:
        return sorted(self._data_start)

    def describe(self) -> str:
        return f"checkpoint {self.path} ({len(self._data_start)} file(s), {len(self._entries)} tensors)"

    def _where(self, name: str) -> str:
        return str(self._entries[name].file) if name in self._entries else str(self.path)

    def _label(self, name: str) -> str:
        return label(self._entries[name].stored_name) if name in self._entries else label(name)

    def _view(self, name: str) -> np.ndarray:
        """The stored bytes of ``name`` as an (unaligned, read-only) array in its canonical shape."""
        e = self._entry(name)
        dtype = self.storage_dtype(name)
        mm = self._maps.get(e.file)
        if mm is None:
            mm = self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        if mm.size < self._data_start[e.file] + e.end:  # the file shrank since it was opened
            raise CheckpointError(f"{e.file}: {self._label(name)}: data_offsets run past the end of "
                                  "the file: truncated")
        count = math.prod(e.stored_shape)
        arr = np.frombuffer(mm, dtype=RAW_NUMPY[dtype], count=count,
                            offset=self._data_start[e.file] + e.begin)
        return arr.reshape(e.shape)

    def get_raw(self, name: str) -> np.ndarray:
        return np.array(self._view(name))

    def _raw_parts(self, name: str):
        yield self._view(name)  # the memmap itself: the blocks are read from the page cache

    def get(self, name: str) -> np.ndarray:
        # converted straight from the memmap: no intermediate copy of the raw bytes
        return self.check_finite(name, raw_to_float64(self._view(name), self.storage_dtype(name)))

    def get_rows(self, name: str, rows) -> np.ndarray:
        raw = self.get_raw_rows(name, rows)
        return self.check_finite(name, raw_to_float64(raw, self.storage_dtype(name)))

    def get_raw_rows(self, name: str, rows) -> np.ndarray:
        return self._view(name)[np.asarray(rows, dtype=np.int64)]


def open_source(path: str | os.PathLike) -> SafetensorsSource:
    """Open a checkpoint directory (``config.json`` + ``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``). Every file is validated now: the config (``KimiConfig``),
    the index, each safetensors header as the format defines it (``safetensors_format``), every
    expected tensor present with its shape and a supported dtype. Values are read on ``get`` (and
    checked finite there). Files are followed through links only inside the directory, or from a
    hub-cache snapshot into its ``blobs/``. transformers 5.x's names of the dense MLP are read as
    the hub's (``kimi.tensors.transformers_aliases``). Unknown extra tensors give a
    ``CheckpointWarning``."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    cfg_path = _inside(root, CONFIG_FILE)
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: not found (a checkpoint directory needs config.json)")
    try:
        config = KimiConfig.from_json(cfg_path)
    except ConfigError as exc:
        raise CheckpointConfigError(str(exc)) from None

    single, index = _inside(root, SINGLE_FILE), _inside(root, INDEX_FILE)
    if single.is_file():
        files, weight_map = [single], None
    elif index.is_file():
        weight_map = _read_index(index)
        files = []
        for shard in dict.fromkeys(weight_map.values()):
            f = _inside(root, shard)
            if not f.is_file():
                example = next(n for n, s in weight_map.items() if s == shard)
                raise CheckpointError(f"{index}: shard '{label(shard)}' (holding {label(example)}) "
                                      "does not exist")
            files.append(f)
    else:
        raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}")

    entries, data_start = _collect(files, weight_map, index)
    entries = _rename_transformers(entries, config)
    config = _kda_A_log(entries, config)
    _check_expected(entries, config, files[0] if weight_map is None else index)
    extra = [n for n in entries if n not in expected_tensors(config)]
    if extra:
        shown = ", ".join(label(n) for n in extra[:5]) + (f", ... ({len(extra)} in all)" if len(extra) > 5 else "")
        warnings.warn(f"{root}: ignoring {len(extra)} unexpected tensor(s): {shown}",
                      CheckpointWarning, stacklevel=2)
    return SafetensorsSource(root, config, entries, data_start)


def _inside(root: Path, name: str) -> Path:
    try:
        return inside(root, name)
    except InvalidInput as exc:
        raise CheckpointError(str(exc)) from None


def _collect(files: list[Path], weight_map: dict[str, str] | None, index: Path):
    """Every tensor of the files (validated headers) as ``_Entry``, and each file's data start."""
    entries: dict[str, _Entry] = {}
    data_start: dict[Path, int] = {}
    for f in files:
        header = read_header(f)
        data_start[f] = header.data_start
        for name, info in header.tensors.items():
            if weight_map is not None and weight_map.get(name, f.name) != f.name:
                continue  # the index places it elsewhere; that shard's copy is the one read
            if name in entries:
                raise CheckpointError(f"{f}: {label(name)}: also stored in {entries[name].file}")
            entries[name] = _Entry(f, name, info.dtype, info.shape, info.shape, info.begin, info.end)
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in entries:
                raise CheckpointError(f"{index}: {label(name)} is mapped to {label(shard)}, which does "
                                      "not contain it")
    return entries, data_start


def _rename_transformers(entries: dict[str, _Entry], config: KimiConfig) -> dict[str, _Entry]:
    """transformers' names of the dense MLP -> the hub's; a layer stored under both is an error."""
    aliases = transformers_aliases(config)
    if not any(n in aliases for n in entries):
        return entries
    for alt, hub in aliases.items():
        if alt in entries and hub in entries:
            raise CheckpointError(f"{entries[alt].file}: both {hub} (hub layout) and {alt} "
                                  "(transformers layout) are present; a checkpoint holds one of them")
    return {aliases.get(n, n): e for n, e in entries.items()}


def _kda_A_log(entries: dict[str, _Entry], config: KimiConfig) -> KimiConfig:
    """A bounded-gate checkpoint whose KDA layers hold no ``A_log`` at all has the gate without it
    (``config.kda_A_log`` False); some layers without it is a missing tensor, as for the softplus gate."""
    if config.gate_lower_bound is None:
        return config
    names = [layer_prefix(i) + "self_attn.A_log" for i in range(config.num_hidden_layers) if config.is_kda_layer(i)]
    if names and not any(n in entries for n in names):
        return dataclasses.replace(config, kda_A_log=False)
    return config


def _check_expected(entries: dict[str, _Entry], config: KimiConfig, where: Path) -> None:
    """Every expected tensor present, with its shape (or an accepted alternative) and a dtype the
    model reads; the entry takes the canonical shape."""
    expected = expected_tensors(config)
    for name, want in expected.items():
        e = entries.get(name)
        if e is None:
            missing = [n for n in expected if n not in entries]
            raise CheckpointError(f"{where}: missing tensor {name} (expected shape {want})"
                                  + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        stored = e.stored_shape
        if stored != want and stored not in alternative_shapes(name, want):
            alts = "".join(f" or {a}" for a in alternative_shapes(name, want))
            raise CheckpointError(f"{e.file}: {label(e.stored_name)}: expected shape {want}{alts}, got {stored}")
        if e.code not in DTYPE_CODES:
            raise CheckpointError(f"{e.file}: {label(e.stored_name)}: unsupported dtype {e.code}; "
                                  f"expected one of {', '.join(DTYPE_CODES)}")
        e.shape = want


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of ``model.safetensors.index.json``: tensor name -> a file name in the
    directory (no folders, no links out: the shard is opened through ``inside``)."""
    try:
        d = as_object(read_json_file(index, max_bytes=MAX_INDEX_BYTES), str(index))
        wm = as_object(field(d, "weight_map", str(index)), f"{index}: weight_map")
        if len(wm) > MAX_TENSORS:
            raise InvalidInput(f"{index}: weight_map: {len(wm)} entries, more than the limit of {MAX_TENSORS}")
        for name, shard in wm.items():
            as_file_name(shard, f"{index}: weight_map: {label(name)}: shard")
    except InvalidInput as exc:
        raise CheckpointError(str(exc)) from None
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
    """Spools one shard's tensors (wider dtypes first, so every tensor stays aligned) then writes
    header + data."""

    WIDTHS = (8, 4, 2)

    def __init__(self, tmp: Path, k: int):
        self.path = tmp / f".shard-{k}"
        self.spools = {w: open(tmp / f".spool-{k}-{w}", "w+b") for w in self.WIDTHS}
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
        base, start = {}, 0
        for w in self.WIDTHS:
            base[w], start = start, start + self.spools[w].tell()
        header: dict = {"__metadata__": {"format": "pt"}}
        for name, code, shape, width, offset in self.items:
            begin = offset + base[width]
            header[name] = {"dtype": code, "shape": list(shape),
                            "data_offsets": [begin, begin + math.prod(shape) * width]}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the safetensors library writes
        with open(self.path, "wb") as out:
            out.write(len(text).to_bytes(8, "little"))
            out.write(text)
            for width in self.WIDTHS:
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
