"""The safetensors file format, validated as the safetensors library validates it, case for case.

A file is an 8-byte little-endian header length ``n`` (at most 100,000,000), ``n`` bytes of UTF-8
JSON, then the data section. The JSON is an object: an optional ``"__metadata__"`` (null, or an
object of string values) and one entry per tensor, ``name -> {"dtype", "shape", "data_offsets":
[begin, end]}``. What the library (serde) also accepts is accepted here too: an entry written as
the array ``[dtype, shape, data_offsets]``, a dtype written ``{"F32": null}``, unknown fields in
an entry (ignored), a repeated tensor name (the last one counts). Shapes and offsets are unsigned
64-bit JSON integers; JSON nested deeper than 127 levels is refused.

The entries, sorted by ``data_offsets``, must tile the data section exactly: the first begins at
0, each begins where the previous one ends, each spans ``prod(shape) * bits(dtype) / 8`` bytes (a
whole number of bytes, computed without 64-bit overflow), and the last ends at the end of the
file. So no two tensors share bytes, no byte is left over, and a header length off by a few bytes
is caught. tests/kimi/test_safetensors_format.py fuzzes this reader against the library.

Errors are ``InvalidInput`` without the file's content: tensor names appear escaped and shortened
(``validate.label``), values as their JSON type, offsets and sizes as numbers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .validate import INT_LIMIT, InvalidInput, Pairs, kind, label, parse_json

MAX_HEADER_BYTES = 100_000_000  # the library's limit
METADATA_KEY = "__metadata__"
ENTRY_FIELDS = ("dtype", "shape", "data_offsets")
# every dtype of the format (safetensors 0.8) with its width in bits
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
              "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64,
              "I64": 64, "U64": 64}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str                # a key of DTYPE_BITS
    shape: tuple[int, ...]
    begin: int                # byte offsets in the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    data_start: int                   # 8 + n: where the data section begins in the file
    tensors: dict[str, TensorInfo]    # in file order
    metadata: dict[str, str] | None


def _u64(value, name: str, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < INT_LIMIT:
        raise InvalidInput(f"{name}: {what}: expected an unsigned 64-bit integer, got {kind(value)}")
    return value


def _dtype(value, name: str) -> str:
    if isinstance(value, Pairs) and len(value) == 1 and value[0][1] is None:  # {"F32": null}
        value = value[0][0]
    if not isinstance(value, str) or value not in DTYPE_BITS:
        shown = "a string that names no safetensors dtype" if isinstance(value, str) else kind(value)
        raise InvalidInput(f"{name}: dtype: expected a safetensors dtype (F32, BF16, ...), got {shown}")
    return value


def _entry(name: str, value) -> TensorInfo:
    shown = label(name)
    if isinstance(value, list) and not isinstance(value, Pairs):  # the positional form
        if len(value) != 3:
            raise InvalidInput(f"{shown}: header entry: expected dtype, shape and data_offsets, "
                               f"got {kind(value)}")
        fields = dict(zip(ENTRY_FIELDS, value))
    elif isinstance(value, Pairs):
        fields = {}
        for k, v in value:
            if k in ENTRY_FIELDS:
                if k in fields:
                    raise InvalidInput(f"{shown}: header entry repeats '{k}'")
                fields[k] = v
        for k in ENTRY_FIELDS:
            if k not in fields:
                raise InvalidInput(f"{shown}: header entry lacks '{k}'")
    else:
        raise InvalidInput(f"{shown}: header entry: expected an object with dtype, shape and "
                           f"data_offsets, got {kind(value)}")
    dtype = _dtype(fields["dtype"], shown)
    shape, offs = fields["shape"], fields["data_offsets"]
    if not isinstance(shape, list) or isinstance(shape, Pairs):
        raise InvalidInput(f"{shown}: shape: expected an array, got {kind(shape)}")
    dims = tuple(_u64(s, shown, "shape") for s in shape)
    if not isinstance(offs, list) or isinstance(offs, Pairs) or len(offs) != 2:
        raise InvalidInput(f"{shown}: data_offsets: expected [begin, end], got {kind(offs)}")
    begin, end = (_u64(o, shown, "data_offsets") for o in offs)
    return TensorInfo(dtype, dims, begin, end)


def _metadata(value) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, Pairs):
        raise InvalidInput(f"{METADATA_KEY}: expected an object of strings or null, got {kind(value)}")
    out = {}
    for k, v in value:
        if not isinstance(v, str):
            raise InvalidInput(f"{METADATA_KEY}: '{label(k)}': expected a string, got {kind(v)}")
        out[k] = v
    return out


def nbytes_of(info: TensorInfo, shown: str) -> int:
    """``prod(shape) * bits / 8`` as the library computes it: 64-bit, overflow and partial bytes
    refused."""
    n = 1
    for s in info.shape:
        n *= s
        if n >= INT_LIMIT:
            raise InvalidInput(f"{shown}: shape {info.shape} has more elements than 64 bits count")
    bits = n * DTYPE_BITS[info.dtype]
    if bits >= INT_LIMIT:
        raise InvalidInput(f"{shown}: shape {info.shape} of {info.dtype} overflows 64 bits of size")
    if bits % 8:
        raise InvalidInput(f"{shown}: {n} elements of {info.dtype} are not a whole number of bytes")
    return bits // 8


def parse_header(text: bytes, data_size: int) -> tuple[dict[str, TensorInfo], dict[str, str] | None]:
    """The tensors (file order) and metadata of header bytes ``text`` followed by ``data_size``
    bytes of data; ``InvalidInput`` (without a file prefix) for anything the library refuses."""
    doc = parse_json(text, what="header", pairs=True)
    if not isinstance(doc, Pairs):
        raise InvalidInput(f"header: expected a JSON object, got {kind(doc)}")
    tensors: dict[str, TensorInfo] = {}
    metadata, seen_metadata = None, False
    for name, value in doc:
        if name == METADATA_KEY:
            if seen_metadata:
                raise InvalidInput(f"header: '{METADATA_KEY}' appears twice")
            seen_metadata, metadata = True, _metadata(value)
            continue
        tensors.pop(name, None)  # a repeated name: the last entry counts (as in the library)
        tensors[name] = _entry(name, value)
    _check_tiling(tensors, data_size)
    return tensors, metadata


def _check_tiling(tensors: dict[str, TensorInfo], data_size: int) -> None:
    pos, prev = 0, None
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        shown = label(name)
        if info.begin > pos:
            raise InvalidInput(f"{shown}: data_offsets [{info.begin}, {info.end}] leave a gap of "
                               f"{info.begin - pos} bytes before it (tensors must tile the data)")
        if info.begin < pos:
            raise InvalidInput(f"{shown}: data_offsets [{info.begin}, {info.end}] overlap "
                               f"{label(prev)} by {pos - info.begin} bytes")
        if info.end < info.begin:
            raise InvalidInput(f"{shown}: data_offsets [{info.begin}, {info.end}] end before they begin")
        want = nbytes_of(info, shown)
        if info.nbytes != want:
            raise InvalidInput(f"{shown}: data_offsets [{info.begin}, {info.end}] span {info.nbytes} "
                               f"bytes, expected {want} for {info.dtype} {info.shape}")
        pos, prev = info.end, name
    if pos > data_size:
        raise InvalidInput(f"{label(prev)}: data_offsets end at byte {pos}, past the end of the data "
                           f"({data_size} bytes): truncated file")
    if pos < data_size:
        raise InvalidInput(f"{data_size - pos} bytes after the last tensor's data (the header "
                           "length or data_offsets are wrong, or bytes were appended)")


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate the header of the safetensors file ``path`` against its size. Errors are
    ``InvalidInput`` prefixed with ``path``."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise InvalidInput(f"{path}: truncated file ({size} bytes; a safetensors file starts "
                                   "with an 8-byte header length)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise InvalidInput(f"{path}: header length field exceeds the format's limit of "
                                   f"{MAX_HEADER_BYTES} bytes: not a safetensors file")
            if 8 + n > size:
                raise InvalidInput(f"{path}: header length field runs past the end of the file "
                                   f"({size} bytes): truncated or not a safetensors file")
            text = f.read(n)
    except IsADirectoryError:
        raise InvalidInput(f"{path}: is a directory, not a safetensors file") from None
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    if len(text) < n:
        raise InvalidInput(f"{path}: the file shrank while its header was read")
    try:
        tensors, metadata = parse_header(text, size - 8 - n)
    except InvalidInput as exc:
        raise InvalidInput(f"{path}: {exc}") from None
    return Header(8 + n, tensors, metadata)
