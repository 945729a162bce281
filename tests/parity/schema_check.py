"""A small JSON-Schema validator for the documented report schemas (the keywords they use: type,
const, enum, required, properties, additionalProperties, items, minItems, minimum,
exclusiveMinimum, oneOf, local $ref). Returns the list of violations, each with its JSON path."""
from __future__ import annotations

import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def validate(value, schema: dict, root: dict | None = None, path: str = "$") -> list[str]:
    root = root if root is not None else schema
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return validate(value, target, root, path)
    errors = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, t) for t in types):
            return [f"{path}: expected {'/'.join(types)}, got {type(value).__name__} {value!r:.60}"]
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not one of {schema['enum']}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        errors.append(f"{path}: {value} < minimum {schema['minimum']}")
    if "exclusiveMinimum" in schema and _is(value, "number") and value <= schema["exclusiveMinimum"]:
        errors.append(f"{path}: {value} <= exclusive minimum {schema['exclusiveMinimum']}")
    if "oneOf" in schema:
        ok = [s for s in schema["oneOf"] if not validate(value, s, root, path)]
        if len(ok) != 1:
            errors.append(f"{path}: matches {len(ok)} of the oneOf alternatives, expected exactly 1")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing required {key!r}")
        props = schema.get("properties", {})
        for key, sub in value.items():
            if key in props:
                errors += validate(sub, props[key], root, f"{path}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += validate(sub, schema["additionalProperties"], root, f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected key {key!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: {len(value)} items < minItems {schema['minItems']}")
        if "items" in schema:
            for i, item in enumerate(value):
                errors += validate(item, schema["items"], root, f"{path}[{i}]")
    return errors


def load_schema(name: str) -> dict:
    return json.loads((DOCS / name).read_text())
