"""The endpoint-spec reference (docs/endpoint-spec.md), generated from the spec's JSON schema.

``python -m controlplane.spec_reference > docs/endpoint-spec.md`` (``make schema`` runs it):
one table per section of the spec, each field with its type, default, bounds and the
description the code gives it, so the reference cannot drift from what the loader accepts
(``tests/test_specs.py`` compares the committed file with this output).

>>> "| `name` |" in reference()
True
"""

from __future__ import annotations

import json

from controlplane.specs import json_schema

HEADER = """# Endpoint spec reference

Generated from the code (`controlplane/specs.py`) by `make schema`; do not edit by hand.
A spec is YAML (or JSON) given to `modelplane endpoints create -f`; unknown fields are
refused with a message naming them. The JSON schema is
[endpoint-spec.schema.json](endpoint-spec.schema.json); examples are in
[examples/endpoints/](../examples/endpoints/).
"""
BOUNDS = (("minimum", "≥ {}"), ("exclusiveMinimum", "> {}"), ("maximum", "≤ {}"), ("exclusiveMaximum", "< {}"),
          ("minLength", "length ≥ {}"), ("maxLength", "length ≤ {}"), ("minItems", "≥ {} items"),
          ("maxItems", "≤ {} items"), ("pattern", "matches `{}`"))


def _resolve(schema: dict, defs: dict) -> dict:
    if "$ref" in schema:
        return defs[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _type(schema: dict, defs: dict) -> str:
    """A short type: ``integer``, ``number or null``, ``list of integer``, ``one of a, b``."""
    if "anyOf" in schema:
        return " or ".join(_type(option, defs) for option in schema["anyOf"])
    resolved = _resolve(schema, defs)
    if "enum" in resolved:
        return "one of " + ", ".join(f"`{value}`" for value in resolved["enum"])
    if resolved.get("type") == "array":
        return f"list of {_type(resolved.get('items', {}), defs)}"
    if resolved.get("type") == "object" and "$ref" in schema:
        return f"section `{schema['$ref'].rsplit('/', 1)[-1]}`"
    return str(resolved.get("type", "any"))


def _bounds(schema: dict, defs: dict) -> str:
    parts = []
    for option in schema.get("anyOf", [schema]):
        option = _resolve(option, defs)
        parts += [text.format(option[key]) for key, text in BOUNDS if key in option]
        if option.get("type") == "array":
            items = _resolve(option.get("items", {}), defs)
            parts += [f"each {text.format(items[key])}" for key, text in BOUNDS if key in items]
    return ", ".join(parts)


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(properties: dict, required: list[str], defs: dict, prefix: str) -> list[str]:
    lines = ["| field | type | default | bounds | what it does |", "|---|---|---|---|---|"]
    for name, field in properties.items():
        section = _resolve(field, defs)
        is_section = section.get("type") == "object" and "properties" in section
        default = "required" if name in required else (
            "see below" if is_section else f"`{json.dumps(field.get('default'))}`")
        description = field.get("description") or section.get("description", "")
        lines.append(f"| `{prefix}{name}` | {_cell(_type(field, defs))} | {_cell(default)} | "
                     f"{_cell(_bounds(field, defs))} | {_cell(description)} |")
    return lines


def reference(schema: dict | None = None) -> str:
    schema = schema or json_schema()
    defs = schema.get("$defs", {})
    out = [HEADER, "## Top level", "", *_table(schema["properties"], schema.get("required", []), defs, "")]
    for name, field in schema["properties"].items():
        section = _resolve(field, defs)
        if section.get("type") != "object" or "properties" not in section:
            continue
        out += ["", f"## `{name}`", ""]
        if section.get("description"):
            out += [_cell(section["description"]), ""]
        out += _table(section["properties"], section.get("required", []), defs, f"{name}.")
        for sub, subfield in section["properties"].items():  # one level down (routing.sticky, …)
            inner = _resolve(subfield, defs)
            if inner.get("type") == "object" and "properties" in inner:
                out += ["", f"### `{name}.{sub}`", "", *_table(inner["properties"], inner.get("required", []), defs,
                                                             f"{name}.{sub}.")]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
