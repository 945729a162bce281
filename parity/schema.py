"""A small JSON-schema validator (the subset parity's schemas use: type, enum, const, required,
properties, additionalProperties, items, minimum, local $ref), so the certificate schema is checked
without a new dependency. ``jsonschema`` is used instead when installed."""
from __future__ import annotations

import json
from pathlib import Path

SCHEMAS = Path(__file__).parent / "schemas"

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def load(name: str = "certificate") -> dict:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


def _is(value, t) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def errors(doc, schema: dict | None = None) -> list[str]:
    """Every violation of ``schema`` (default: the certificate schema) by ``doc``, as
    ``"path: message"`` strings; empty when valid."""
    root = schema or load()
    out: list[str] = []
    _check(doc, root, root, "$", out)
    return out


def validate(doc, schema: dict | None = None) -> None:
    """Raise ValueError listing the first violations."""
    errs = errors(doc, schema)
    if errs:
        raise ValueError(f"{len(errs)} schema violation(s): " + "; ".join(errs[:10]))


def _resolve(ref: str, root: dict) -> dict:
    if not ref.startswith("#/"):
        raise ValueError(f"unsupported $ref {ref!r}")
    node = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _check(v, s: dict, root: dict, path: str, out: list) -> None:
    if "$ref" in s:
        _check(v, _resolve(s["$ref"], root), root, path, out)
        return
    if "const" in s and v != s["const"]:
        out.append(f"{path}: expected {s['const']!r}, got {v!r}")
    if "enum" in s and v not in s["enum"]:
        out.append(f"{path}: {v!r} not one of {s['enum']}")
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_is(v, t) for t in types):
            out.append(f"{path}: expected type {s['type']}, got {type(v).__name__}")
            return
    if "minimum" in s and _is(v, "number") and v < s["minimum"]:
        out.append(f"{path}: {v} < minimum {s['minimum']}")
    if isinstance(v, dict):
        for k in s.get("required", []):
            if k not in v:
                out.append(f"{path}: missing required property {k!r}")
        props = s.get("properties", {})
        extra = s.get("additionalProperties", True)
        for k, x in v.items():
            if k in props:
                _check(x, props[k], root, f"{path}.{k}", out)
            elif extra is False:
                out.append(f"{path}: unexpected property {k!r}")
            elif isinstance(extra, dict):
                _check(x, extra, root, f"{path}.{k}", out)
    if isinstance(v, list) and "items" in s:
        for i, x in enumerate(v):
            _check(x, s["items"], root, f"{path}[{i}]", out)
