"""The one container of the tensor files kimi-parity writes and reads: a safetensors file whose
metadata entry ``"kimi-parity"`` holds a JSON header that opens with the file's format tag and
version (``{"format": "kimi-parity/calls", "version": 1, ...}``) and follows the format's schema
(``parity/schemas/<schema>.schema.json``).

Its formats are dumps (``parity.diff.engines.dump``), recorded calls
(``parity.record.watch.callfile``) and captured cases (``parity.record.capture.casefile``); each
keeps its :class:`Format` beside its module. :func:`write` writes a file whole or not at all;
:func:`read_header` reads one's header (the safetensors layout as the library checks it, the tag,
the version, the schema) without its tensors. Every problem is one line naming the file, raised as
the format's own error class. Repros (``parity.certify.repro``) are plain safetensors that a script
without kimi-parity reads: :func:`write_tensors`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from kimi.safetensors_format import read_header as safetensors_header
from kimi.validate import InvalidInput, parse_json
from parity.atomic import atomic_write
from parity.errors import InputError
from parity.schema import errors, load

METADATA_KEY = "kimi-parity"


@dataclass(frozen=True)
class Format:
    """One format of the container. ``tag``: the header's ``format`` (``"kimi-parity/dump"``);
    ``version``: the one this tool writes and reads; ``schema``: its schema's name under
    ``parity/schemas/``; ``noun``: what an error calls a file of it (``"calls file"``); ``error``:
    the exception class its problems raise (one line, the file first)."""

    tag: str
    version: int
    schema: str
    noun: str
    error: type[Exception] = InputError

    @property
    def short(self) -> str:
        """The tag without ``kimi-parity/`` (``"dump"``), as the version error says it."""
        return self.tag.rpartition("/")[2]


@dataclass(frozen=True)
class Header:
    """A file's checked header: ``head`` (the JSON header) and ``tensors`` (name ->
    ``kimi.safetensors_format.TensorInfo``: dtype, shape, offsets)."""

    head: dict
    tensors: dict


def write_tensors(path, tensors: dict, metadata: dict | None = None, *, durable: bool = True) -> Path:
    """Write ``tensors`` (name -> contiguous CPU torch tensor) as a safetensors file at ``path``,
    atomically (``parity.atomic``; ``durable``: forced to the disk first); ``metadata``: its string
    entries. safetensors writes the file itself, from the tensors' memory (no copy of the whole
    file in this process: a watch keeps megabytes)."""
    return atomic_write(path, fill=lambda name: save_file(tensors, name, metadata=metadata), durable=durable)


def write(path, fmt: Format, fields: dict, tensors: dict, *, durable: bool = True) -> Path:
    """Write a file of ``fmt``: the header ``{"format": tag, "version": version, **fields}`` (strict
    JSON: NaN refused) and ``tensors`` (name -> contiguous CPU torch tensor), atomically."""
    head = {"format": fmt.tag, "version": fmt.version, **fields}
    return write_tensors(path, tensors, {METADATA_KEY: json.dumps(head, allow_nan=False)}, durable=durable)


def read_header(path, fmt: Format, *, schema: bool = True) -> Header:
    """Read and check the header of a file of ``fmt``: its safetensors layout against its size
    (``kimi.safetensors_format``: a truncated file is refused here), the ``"kimi-parity"``
    entry as strict JSON (``kimi.validate.parse_json``), the tag, the version and, with
    ``schema``, the format's schema. ``fmt.error`` (one line naming the file) otherwise."""
    path = Path(path)
    fail = fmt.error
    try:
        layout = safetensors_header(path)
    except InvalidInput as exc:
        raise fail(str(exc)) from None
    raw = (layout.metadata or {}).get(METADATA_KEY)
    if not isinstance(raw, str):
        raise fail(f"{path}: not a kimi-parity {fmt.noun} (no {METADATA_KEY!r} entry in the safetensors metadata)")
    try:
        head = parse_json(raw, what=f"{path}: the {METADATA_KEY!r} metadata")
    except InvalidInput as exc:
        raise fail(str(exc)) from None
    if not isinstance(head, dict) or head.get("format") != fmt.tag:
        found = head.get("format") if isinstance(head, dict) else None
        raise fail(f"{path}: format {found!r}, expected {fmt.tag!r}")
    if head.get("version") != fmt.version:
        raise fail(f"{path}: {fmt.short} format version {head.get('version')!r}; this tool reads {fmt.version}")
    if schema:
        bad = errors(head, load(fmt.schema))
        if bad:
            raise fail(f"{path}: header: {bad[0]}")
    return Header(head, layout.tensors)
