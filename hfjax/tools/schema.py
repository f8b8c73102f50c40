"""A small JSON-schema check for tool arguments: required keys, types, enums, and unknown keys
when the schema sets `"additionalProperties": false`. It covers what function specs use; it is
not a full JSON-schema implementation (no $ref, patterns or numeric ranges)."""

from __future__ import annotations

from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _type_ok(value: Any, kind: str) -> bool:
    if kind not in _TYPES:
        return True  # a type this check does not know is not ours to refuse
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False  # JSON true is not a number, though Python's bool is an int
    # "integer" takes ints only (not 2.0, which JSON Schema would accept): the tool then gets
    # the Python type its schema names.
    return isinstance(value, _TYPES[kind])


def check_value(value: Any, schema: dict, where: str) -> str | None:
    """Why `value` does not fit `schema` (a sentence naming `where`), or None when it does."""
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not any(_type_ok(value, k) for k in kinds):
            return f"{where} must be of type {' or '.join(kinds)}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {value!r}"
    if isinstance(value, dict) and ("properties" in schema or "required" in schema):
        return check_object(value, schema, where)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            why = check_value(item, schema["items"], f"{where}[{i}]")
            if why:
                return why
    return None


def check_object(args: dict, schema: dict, where: str = "arguments") -> str | None:
    """Why the object `args` does not fit the object `schema`, or None when it does."""
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"{where} is missing required {', '.join(repr(k) for k in missing)}"
    if schema.get("additionalProperties") is False:
        extra = [k for k in args if k not in props]
        if extra:
            return (f"{where} has unknown {', '.join(repr(k) for k in extra)}; known: "
                    f"{', '.join(props) or '(none)'}")
    for key, value in args.items():
        if key in props:
            why = check_value(value, props[key], f"{where}.{key}")
            if why:
                return why
    return None
