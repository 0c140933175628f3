#!/usr/bin/env python3
"""Writes src/clade/_generated.py: one dataclass per object schema of
docs/openapi.json's components.schemas, with `from_json` (a decoded JSON
answer to the model) and `to_json` (a model to a request body).

The generated file is committed; tests/test_generated.py regenerates it in
memory and fails when it differs, so a schema change in the API fails the
suite until this script is run again:

    python3 sdk/python/scripts/generate_models.py
"""

from __future__ import annotations

import json
import keyword
import textwrap
import sys
from pathlib import Path
from typing import AbstractSet, Any, Dict, List, Optional, Tuple

SDK_DIR = Path(__file__).resolve().parents[1]
OPENAPI = SDK_DIR.parents[1] / "docs" / "openapi.json"
OUTPUT = SDK_DIR / "src" / "clade" / "_generated.py"

HEADER = '''\
"""Models of Clade's API, generated from docs/openapi.json by
sdk/python/scripts/generate_models.py. Do not edit: run the script."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional


class Model:
    """What every model shares: its JSON form, without the unset fields."""

    def to_json(self) -> Dict[str, Any]:
        body: Dict[str, Any] = {}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if value is not None:
                body[field.metadata.get("json", field.name)] = _to_json(value)
        return body


def _to_json(value: Any) -> Any:
    if isinstance(value, Model):
        return value.to_json()
    if isinstance(value, list):
        return [_to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_json(item) for key, item in value.items()}
    return value
'''

SCALARS = {"string": "str", "integer": "int", "boolean": "bool", "number": "float"}


class Field:
    def __init__(self, json_name: str, annotation: str, decode: str, required: bool, doc: str):
        self.json_name = json_name
        self.name = json_name + "_" if keyword.iskeyword(json_name) else json_name
        self.annotation = annotation
        self.decode = decode  # an expression of `v`, the JSON value
        self.required = required
        self.doc = doc


def ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def types_of(schema: Dict[str, Any]) -> Tuple[List[str], bool]:
    """The schema's JSON types without null, and whether null is allowed."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else ([kind] if kind else [])
    return [k for k in kinds if k != "null"], "null" in kinds


def python_type(schema: Dict[str, Any], raw: AbstractSet[str] = frozenset()) -> Tuple[str, str, bool]:
    """(annotation without Optional, decoder of `v`, nullable). `raw` names
    the schemas that are raw bytes (`bytes` aliases, not models)."""
    if "$ref" in schema:
        name = ref_name(schema["$ref"])
        return name, "v" if name in raw else f"{name}.from_json(v)", False
    if "oneOf" in schema or "anyOf" in schema:
        options: List[Dict[str, Any]] = schema.get("oneOf") or schema.get("anyOf") or []
        concrete = [o for o in options if o.get("type") != "null"]
        nullable = len(concrete) < len(options)
        if len(concrete) == 1:
            annotation, decode, inner_nullable = python_type(concrete[0], raw)
            return annotation, decode, nullable or inner_nullable
        return "Any", "v", nullable
    kinds, nullable = types_of(schema)
    if len(kinds) != 1:
        return "Any", "v", nullable
    kind = kinds[0]
    if kind in SCALARS:
        return SCALARS[kind], "v", nullable
    if kind == "array":
        item_annotation, item_decode, _ = python_type(schema.get("items", {}), raw)
        if item_decode == "v":
            return f"List[{item_annotation}]", "list(v)", nullable
        return f"List[{item_annotation}]", f"[{item_decode.replace('(v)', '(item)')} for item in v]", nullable
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            value_annotation, value_decode, _ = python_type(extra, raw)
            if value_decode == "v":
                return f"Dict[str, {value_annotation}]", "dict(v)", nullable
        return "Dict[str, Any]", "dict(v)", nullable
    return "Any", "v", nullable


def fields_of(schema: Dict[str, Any], raw: AbstractSet[str]) -> List[Field]:
    required = set(schema.get("required", []))
    fields = []
    for json_name, prop in schema.get("properties", {}).items():
        annotation, decode, nullable = python_type(prop, raw)
        is_required = json_name in required
        if nullable or not is_required:
            annotation = f"Optional[{annotation}]" if annotation != "Any" else "Any"
        doc = " ".join((prop.get("description") or "").split())
        fields.append(Field(json_name, annotation, decode, is_required and not nullable, doc))
    # Dataclasses want the fields without defaults first.
    return [f for f in fields if f.required] + [f for f in fields if not f.required]


def docstring(text: str, indent: str) -> List[str]:
    lines = [line.rstrip() for line in text.strip().replace('"""', "'''").splitlines()]
    if not lines or not lines[0]:
        return []
    if len(lines) == 1:
        return [f'{indent}"""{lines[0]}"""']
    return [f'{indent}"""{lines[0]}'] + [f"{indent}{line}" if line else "" for line in lines[1:]] + [f'{indent}"""']


def render_model(name: str, schema: Dict[str, Any], raw: AbstractSet[str]) -> List[str]:
    out = ["", "", "@dataclasses.dataclass", f"class {name}(Model):"]
    out += docstring(schema.get("description", ""), "    ") or [f'    """`{name}` in docs/openapi.json."""']
    fields = fields_of(schema, raw)
    out.append("")
    for field in fields:
        out += [f"    #: {line}" for line in textwrap.wrap(field.doc, 100)]
        metadata = f'metadata={{"json": "{field.json_name}"}}' if field.name != field.json_name else ""
        if field.required:
            default = f" = dataclasses.field({metadata})" if metadata else ""
        else:
            default = f" = dataclasses.field(default=None, {metadata})" if metadata else " = None"
        out.append(f"    {field.name}: {field.annotation}{default}")
    if fields:
        out.append("")
    out += ["    @classmethod", f"    def from_json(cls, data: Mapping[str, Any]) -> {name}:"]
    if not fields:
        out.append("        return cls()")
        return out
    out.append("        return cls(")
    for field in fields:
        if field.required:
            value = field.decode.replace("(v)", f'(data["{field.json_name}"])').replace(" in v]", f' in data["{field.json_name}"]]')
            if field.decode == "v":
                value = f'data["{field.json_name}"]'
        else:
            getter = f'data.get("{field.json_name}")'
            if field.decode == "v":
                value = getter
            else:
                decoded = field.decode.replace("(v)", f'(data["{field.json_name}"])').replace(" in v]", f' in data["{field.json_name}"]]')
                value = f"None if {getter} is None else {decoded}"
        out.append(f"            {field.name}={value},")
    out.append("        )")
    return out


def flatten(schema: Dict[str, Any], schemas: Dict[str, Any]) -> Dict[str, Any]:
    """A schema made of others (`allOf`, as a `#[serde(flatten)]` field makes
    it) as one object schema: its own properties first, then those of the
    schemas it takes in. A part that may be null (`oneOf` null or a schema)
    gives properties that are never required."""
    if "allOf" not in schema:
        return schema
    own: List[Tuple[Dict[str, Any], bool]] = []
    taken: List[Tuple[Dict[str, Any], bool]] = []
    for part in schema["allOf"]:
        options = part.get("oneOf") or part.get("anyOf")
        if options is not None:
            concrete = [o for o in options if o.get("type") != "null"]
            if len(concrete) != 1:
                raise ValueError(f"allOf part {part} is not one schema or null")
            part, may_be_null = concrete[0], len(concrete) < len(options)
        else:
            may_be_null = False
        if "$ref" in part:
            taken.append((flatten(schemas[ref_name(part["$ref"])], schemas), may_be_null))
        else:
            own.append((flatten(part, schemas), may_be_null))
    properties: Dict[str, Any] = {}
    required: List[str] = []
    for part, may_be_null in own + taken:
        properties.update(part.get("properties", {}))
        if not may_be_null:
            required += part.get("required", [])
    merged = {key: value for key, value in schema.items() if key != "allOf"}
    return {**merged, "type": "object", "properties": properties, "required": required}


def render(spec: Dict[str, Any]) -> str:
    lines = HEADER.rstrip("\n").splitlines()
    schemas = spec["components"]["schemas"]
    raw = {name for name in schemas if _is_raw(schemas[name])}
    for name in sorted(schemas):
        schema = flatten(schemas[name], schemas)
        kinds, _ = types_of(schema)
        if kinds == ["object"] or "properties" in schema:
            lines += render_model(name, schema, raw)
        elif name in raw:
            lines += ["", "", f"#: {name}: raw bytes (docs/openapi.json)", f"{name} = bytes"]
    lines += ["", "", "MODELS = {", *[f'    "{n}": {n},' for n in sorted(schemas) if _is_model(flatten(schemas[n], schemas))], "}"]
    return "\n".join(lines) + "\n"


def _is_raw(schema: Dict[str, Any]) -> bool:
    """A schema of raw bytes (`format: binary`): a `bytes` alias, taken as it is."""
    kinds, _ = types_of(schema)
    return kinds == ["string"] and schema.get("format") == "binary" and "properties" not in schema


def _is_model(schema: Dict[str, Any]) -> bool:
    kinds, _ = types_of(schema)
    return kinds == ["object"] or "properties" in schema


def generate(openapi: Optional[Path] = None) -> str:
    return render(json.loads((openapi or OPENAPI).read_text()))


def main() -> int:
    OUTPUT.write_text(generate())
    print(f"wrote {OUTPUT.relative_to(SDK_DIR)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
