"""Reading untrusted input: strict JSON, bounded sizes, finite values, safe error text, confined paths.

Every file a user hands over passes through here: a checkpoint's ``config.json``, safetensors
headers, its index and tokenizer files, golden files, engine dumps, and the command line's output
paths. The rules, the same for every entry point:

* JSON as JSON types it. An integer field takes a JSON integer (not ``8.0``, not ``true``), a flag a
  JSON boolean (not ``"false"``), a number a finite JSON number (``NaN`` and ``Infinity`` are not
  JSON and are refused). Duplicate keys in an object are refused: they would silently pick one.
* Every size has an upper limit, and the error states it.
* Error text never echoes file content: a value is described by its JSON type ("a string of 12
  characters"), numbers are printed as numbers formatted here, and names (keys, tensor names) are
  shortened and escaped by ``label``.
* A file of a folder is followed through symbolic links only while it stays inside the folder, or
  from a hub-cache snapshot into that repository's ``blobs/`` (``inside``).
* A path read from a file is a JSON string that the operating system can take: a file name in a
  folder (``as_file_name``: no separator, not ``.``/``..``, no control character) or a path
  (``as_path``: not empty, no NUL byte), checked before it reaches the file system.

Everything raises ``InvalidInput`` (a ``ValueError``) with one line; callers prefix the file.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
from pathlib import Path

import numpy as np

MAX_JSON_DEPTH = 127  # serde_json's recursion limit as the safetensors library applies it
INT_LIMIT = 2 ** 64   # JSON integers at or beyond it read as floats (serde_json's u64 / i64 range)
MAX_LABEL = 64
REQUIRED = object()


class InvalidInput(ValueError):
    """Unusable input; the message is one line naming the offending thing, never its content."""


# -- safe error text ----------------------------------------------------------------------------------

def label(text, limit: int = MAX_LABEL) -> str:
    """A name from a file, safe to print: non-ASCII and control characters escaped, at most
    ``limit`` characters (longer names are cut and their length is given)."""
    text = str(text)
    escaped = one_line(text).encode("ascii", "backslashreplace").decode("ascii")
    if len(escaped) > limit:
        return f"{escaped[:limit]}...({len(text)} characters)"
    return escaped


def one_line(text: str) -> str:
    """``text`` as one printable line: control characters (a newline in a path from a file) and
    lone surrogates (undecodable bytes of argv) escaped, everything else kept."""
    text = re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\x{ord(m.group()):02x}", str(text))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def kind(value) -> str:
    """The JSON type of ``value`` as an error names it, with the number itself for numbers (a
    number is a size or a position, not content worth hiding) and only the length of a string."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value!r}" if math.isfinite(value) else "a non-finite number"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, (list, tuple)):
        return f"an array of {len(value)} elements"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


# -- JSON ------------------------------------------------------------------------------------------

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in JSON ``text`` (an object holding an array: 2), counted
    without recursion, so a hostile file cannot exhaust the stack before it is refused."""
    bare = _STRING.sub("", text).encode("utf-8", "surrogatepass")
    b = np.frombuffer(bare, dtype=np.uint8)
    if b.size == 0:
        return 0
    step = (np.isin(b, (ord("["), ord("{"))).astype(np.int64)
            - np.isin(b, (ord("]"), ord("}"))).astype(np.int64))
    return int(max(0, np.cumsum(step).max()))


class _Rejected(Exception):
    pass


def _constant(name):
    raise _Rejected(f"{name} is not a JSON number")


def _float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise _Rejected("a number out of the float64 range")
    return x


def _int(text: str):
    """JSON integers as serde_json reads them: in the 64-bit range an int, beyond it a float
    (refused when even that overflows); ``-0`` is a float. Never Python's unbounded int parse."""
    digits = text.lstrip("-")
    if text == "-0":
        return -0.0
    if len(digits) <= 20:
        v = int(text)
        if -2 ** 63 <= v < INT_LIMIT:
            return v
    return _float(text)


class Pairs(list):
    """A JSON object as its (key, value) pairs in file order (``parse_json(..., pairs=True)``)."""


def _unique(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Rejected(f"key '{label(k)}' appears twice in one object")
        out[k] = v
    return out


def _strings_valid(value) -> bool:
    """No lone UTF-16 surrogate in any string (JSON ``"\\ud800"``): it is not Unicode, serde_json
    refuses it, and printing it would fail."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            for item in v:
                if isinstance(item, tuple):  # Pairs
                    stack.extend(item)
                else:
                    stack.append(item)
    return True


def parse_json(data: bytes | str, *, what: str, pairs: bool = False,
               max_depth: int = MAX_JSON_DEPTH):
    """Parse strict JSON. ``data``: UTF-8 bytes or text; ``what``: the prefix of every error (the
    file). Objects become dicts (a repeated key is an error), or ``Pairs`` with ``pairs=True`` (the
    caller decides). Refused: invalid UTF-8, nesting deeper than ``max_depth``, NaN/Infinity,
    numbers beyond float64, lone surrogate escapes, anything ``json`` refuses."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"{what}: not UTF-8 text (invalid byte at offset {exc.start})") from None
    else:
        text = data
    if json_depth(text) > max_depth:
        raise InvalidInput(f"{what}: JSON nested deeper than {max_depth} levels")
    hook = Pairs if pairs else _unique
    try:
        value = json.loads(text, parse_constant=_constant, parse_int=_int, parse_float=_float,
                           object_pairs_hook=hook)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{what}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except _Rejected as exc:
        raise InvalidInput(f"{what}: not valid JSON ({exc})") from None
    except RecursionError:  # unreachable after the depth check; kept so no traceback can escape
        raise InvalidInput(f"{what}: JSON nested too deeply") from None
    if not _strings_valid(value):
        raise InvalidInput(f"{what}: not valid JSON (a string holds a lone surrogate escape)")
    return value


def read_json_file(path: str | os.PathLike, *, max_bytes: int, what: str | None = None):
    """``parse_json`` of a file no larger than ``max_bytes`` (checked before reading)."""
    path = Path(path)
    what = what or str(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise InvalidInput(f"{what}: {size} bytes, more than the {max_bytes} bytes allowed")
        data = path.read_bytes()
    except FileNotFoundError:
        raise InvalidInput(f"{what}: not found") from None
    except IsADirectoryError:
        raise InvalidInput(f"{what}: is a directory, not a file") from None
    except OSError as exc:
        raise InvalidInput(f"{what}: cannot read ({exc.strerror or type(exc).__name__})") from None
    return parse_json(data, what=what)


# -- typed fields ------------------------------------------------------------------------------------

def as_object(value, name: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidInput(f"{name}: expected an object, got {kind(value)}")
    return value


def as_list(value, name: str, *, max_len: int, min_len: int = 0) -> list:
    if not isinstance(value, list):
        raise InvalidInput(f"{name}: expected an array, got {kind(value)}")
    if len(value) > max_len:
        raise InvalidInput(f"{name}: {len(value)} elements, more than the limit of {max_len}")
    if len(value) < min_len:
        raise InvalidInput(f"{name}: {len(value)} elements, expected at least {min_len}")
    return value


def as_int(value, name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """A JSON integer in ``[lo, hi]`` (``hi`` is the stated limit)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(f"{name}: expected an integer, got {kind(value)}")
    if lo is not None and value < lo:
        raise InvalidInput(f"{name}: {value} is below the minimum {lo}")
    if hi is not None and value > hi:
        raise InvalidInput(f"{name}: {value} is above the limit of {hi}")
    return value


def as_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f"{name}: expected true or false, got {kind(value)}")
    return value


def as_float(value, name: str, *, lo: float | None = None, hi: float | None = None,
             lo_open: bool = False) -> float:
    """A finite JSON number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidInput(f"{name}: expected a number, got {kind(value)}")
    x = float(value)
    if not math.isfinite(x):
        raise InvalidInput(f"{name}: expected a finite number, got {kind(value)}")
    if lo is not None and (x <= lo if lo_open else x < lo):
        raise InvalidInput(f"{name}: {x!r} is outside its domain (expected {'>' if lo_open else '>='} {lo!r})")
    if hi is not None and x > hi:
        raise InvalidInput(f"{name}: {x!r} is above the limit of {hi!r}")
    return x


def as_str(value, name: str, *, choices=None, max_len: int = 4096) -> str:
    """A JSON string; with ``choices`` one of them (the error lists the choices, not the value)."""
    if not isinstance(value, str):
        raise InvalidInput(f"{name}: expected a string, got {kind(value)}")
    if len(value) > max_len:
        raise InvalidInput(f"{name}: a string of {len(value)} characters, more than the limit of {max_len}")
    if choices is not None and value not in choices:
        raise InvalidInput(f"{name}: expected one of {', '.join(map(str, choices))}")
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def as_path(value, name: str, *, max_len: int = 4096) -> str:
    """A path read from a file: a non-empty JSON string without a NUL byte (the operating system
    cannot take one), at most ``max_len`` characters."""
    as_str(value, name, max_len=max_len)
    if not value.strip():
        raise InvalidInput(f"{name}: an empty path")
    if "\x00" in value:
        raise InvalidInput(f"{name}: a path holding a NUL byte")
    return value


def as_file_name(value, name: str, *, max_len: int = 255) -> str:
    """A file name read from a file, naming a file directly in a folder: a JSON string of at most
    ``max_len`` characters, no ``/`` or ``\\``, not ``.`` or ``..``, no control character (NUL, a
    newline)."""
    as_str(value, name, max_len=max_len)
    if value in ("", ".", "..") or "/" in value or "\\" in value or _CONTROL.search(value):
        raise InvalidInput(f"{name}: '{label(value)}' must be a file name in the directory")
    return value


def field(obj: dict, key: str, where: str, default=REQUIRED):
    """``obj[key]``, or ``default``; a missing required key is named."""
    if key in obj:
        return obj[key]
    if default is REQUIRED:
        raise InvalidInput(f"{where}: missing required key '{key}'")
    return default


def check_finite(values: np.ndarray, name: str) -> np.ndarray:
    """``values`` unchanged when every one is finite; otherwise an error with the count and the
    first index (not the values around it)."""
    values = np.asarray(values)
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        bad = ~np.isfinite(values)
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidInput(f"{name}: {int(bad.sum())} non-finite values (first at index {first})")
    return values


# -- paths -------------------------------------------------------------------------------------------

def _hub_blobs(real_root: Path) -> Path | None:
    """``<repo>/blobs`` when ``real_root`` is ``<repo>/snapshots/<revision>`` of a hub cache."""
    if real_root.parent.name != "snapshots":
        return None
    blobs = real_root.parent.parent / "blobs"
    return blobs.resolve() if blobs.is_dir() else None


def inside(root: str | os.PathLike, name: str, *, what: str = "checkpoint folder") -> Path:
    """``root / name`` if it is inside ``root`` once links are resolved, or, in a hub-cache snapshot,
    a link into that repository's ``blobs/``; otherwise an error naming the link (never the
    target's content). Missing files are returned as they are (the caller reports them)."""
    root = Path(root)
    if "\x00" in str(root) or "\x00" in str(name):
        raise InvalidInput(f"{label(root / name, 200)}: a path holding a NUL byte")
    path = root / name
    real_root = root.resolve()
    try:
        real = path.resolve()
    except (OSError, RuntimeError):  # a link loop
        raise InvalidInput(f"{path}: a symbolic link that does not resolve (a loop)") from None
    if real == real_root or real_root in real.parents:
        return path
    blobs = _hub_blobs(real_root)
    if blobs is not None and real.parent == blobs:
        return path
    raise InvalidInput(f"{path}: a link to a file outside the {what}; only a hub-cache snapshot's "
                       "links into its blobs/ are followed")


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def _path_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):
        return 4096


def output_file(flag: str, path: str | os.PathLike | None) -> Path | None:
    """An output file named on the command line, checked before any work starts: not empty, its
    folder exists and is writable, the name fits the file system, and it is not a directory or a
    device. ``None`` (the flag not given) passes."""
    if path is None:
        return None
    text = os.fspath(path)
    shown = f"{flag} {label(text, 200)}"
    if not str(text).strip():
        raise InvalidInput(f"{flag}: empty path; give a file name")
    p = Path(text)
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise InvalidInput(f"{shown}: folder {label(folder, 200)} does not exist")
    name_bytes = len(os.fsencode(p.name))
    if name_bytes > _name_max(folder):
        raise InvalidInput(f"{flag}: file name of {name_bytes} bytes, longer than the file system's "
                           f"limit of {_name_max(folder)}")
    full = len(os.fsencode(os.path.abspath(text)))
    if full >= _path_max(folder):
        raise InvalidInput(f"{flag}: path of {full} bytes, longer than the limit of {_path_max(folder)}")
    if p.is_dir():
        raise InvalidInput(f"{shown}: is a directory; give a file name")
    if p.exists() and not p.is_file():
        raise InvalidInput(f"{shown}: exists and is not a regular file")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidInput(f"{shown}: folder {label(folder, 200)} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise InvalidInput(f"{shown}: exists and is not writable")
    return p


def write_error(path, exc: OSError) -> InvalidInput:
    """An OS error while writing ``path`` (disk full, permission) as one line naming the file."""
    reason = exc.strerror or errno.errorcode.get(exc.errno or 0) or type(exc).__name__
    return InvalidInput(f"{label(path, 200)}: cannot write ({reason})")
