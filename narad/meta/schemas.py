"""Topic JSON Schemas: what may be registered, and whether a new version is
compatible with the previous one.

Registration rules: a JSON object or ``true``; at most 256 KiB; nesting at
most 64; ``$ref`` internal only (``#...``); a draft from 2020-12 (default),
2019-09, 07, 06 or 04; valid against its meta-schema (the ``jsonschema``
package). Compatibility is fail-closed and widening-only: every document the
old version accepts must still be accepted, proven keyword by keyword;
anything the checker cannot prove is refused with the path and the reason.
Annotation-only changes are "the same schema" (no new version).

Pure functions; raise narad.errors.BadRequest.
"""

from __future__ import annotations

import json
from typing import Any

from jsonschema import exceptions as js_exceptions
from jsonschema import validators as js_validators

from narad.errors import BadRequest

MAX_SCHEMA_BYTES = 256 * 1024
MAX_NESTING = 64
DRAFTS = {
    "https://json-schema.org/draft/2020-12/schema",
    "https://json-schema.org/draft/2019-09/schema",
    "http://json-schema.org/draft-07/schema",
    "http://json-schema.org/draft-06/schema",
    "http://json-schema.org/draft-04/schema",
}
ANNOTATIONS = {"title", "description", "examples", "$comment", "default", "deprecated", "readOnly",
               "writeOnly", "$id", "$schema", "$anchor"}


def _depth(v: Any, d: int = 0, limit: int = 300) -> int:
    if d > limit:
        return d
    if isinstance(v, dict):
        return max([d + 1, *(_depth(x, d + 1, limit) for x in v.values())])
    if isinstance(v, list):
        return max([d + 1, *(_depth(x, d + 1, limit) for x in v)])
    return d


def _refs(v: Any) -> list[str]:
    out: list[str] = []
    if isinstance(v, dict):
        for k, x in v.items():
            if k in ("$ref", "$dynamicRef", "$recursiveRef") and isinstance(x, str):
                out.append(x)
            else:
                out.extend(_refs(x))
    elif isinstance(v, list):
        for x in v:
            out.extend(_refs(x))
    return out


def parse_registrable(raw: bytes) -> Any:
    """Check a schema document for registration; returns the parsed value."""
    if len(raw) > MAX_SCHEMA_BYTES:
        raise BadRequest(f"invalid argument: schema is larger than {MAX_SCHEMA_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"invalid argument: schema is not valid JSON: {e}") from None
    if doc is not True and not isinstance(doc, dict):
        raise BadRequest("invalid argument: schema must be a JSON object or true")
    if _depth(doc) > MAX_NESTING:
        raise BadRequest(f"invalid argument: schema nests deeper than {MAX_NESTING} levels")
    for ref in _refs(doc):
        if not ref.startswith("#"):
            raise BadRequest(f'invalid argument: schema $ref "{ref[:100]}" must be internal (start with #)')
    if isinstance(doc, dict):
        draft = doc.get("$schema")
        if draft is not None and (not isinstance(draft, str) or draft.rstrip("#") not in DRAFTS):
            raise BadRequest("invalid argument: $schema must name draft 2020-12, 2019-09, 07, 06 or 04")
    cls = js_validators.validator_for(doc, default=js_validators.Draft202012Validator)
    try:
        cls.check_schema(doc)
    except js_exceptions.SchemaError as e:
        path = "/" + "/".join(str(p) for p in e.absolute_path)
        raise BadRequest(f"invalid argument: schema is not a valid JSON Schema at {path}: {e.message}") from None
    return doc


def strip_annotations(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: strip_annotations(x) for k, x in v.items() if k not in ANNOTATIONS}
    if isinstance(v, list):
        return [strip_annotations(x) for x in v]
    return v


def same_schema(a: Any, b: Any) -> bool:
    """Equal as JSON values, ignoring annotations (key order, whitespace and
    number spelling never matter once parsed)."""
    return strip_annotations(a) == strip_annotations(b)


class _Incompatible(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path or '/'}: {reason}")


def check_compatible(old: Any, new: Any) -> None:
    try:
        _compat(strip_annotations(old), strip_annotations(new), "")
    except _Incompatible as e:
        raise BadRequest(f"schema incompatible with previous version: {e}") from None


def _as_dict(s: Any) -> dict[str, Any] | None:
    """True and {} accept everything; False accepts nothing (None here)."""
    if s is True:
        return {}
    if s is False:
        return None
    return s


def _types(s: dict[str, Any]) -> set[str] | None:
    t = s.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else set(t)


# Keywords that only ever reject documents: removing one cannot narrow.
_REMOVABLE = {"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "pattern", "format", "multipleOf",
              "uniqueItems", "contains", "dependentRequired", "dependencies", "propertyNames", "$ref"}
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")


def _compat(old: Any, new: Any, path: str) -> None:
    o, n = _as_dict(old), _as_dict(new)
    if o is None:
        return  # the old schema accepted nothing
    if n is None:
        raise _Incompatible(path, "the new schema accepts nothing")
    if o == n or not n:
        return
    handled = {"type", "required", "properties", "additionalProperties", "enum", "const", "items"} | set(
        _LOWER_BOUNDS + _UPPER_BOUNDS
    )
    ot, nt = _types(o), _types(n)
    if nt is not None:
        if ot is None:
            raise _Incompatible(path, "adds a type restriction")
        widened = set(nt) | ({"integer"} if "number" in nt else set())
        if not ot <= widened:
            raise _Incompatible(path, f"type narrows from {sorted(ot)} to {sorted(nt)}")
    if not set(n.get("required", [])) <= set(o.get("required", [])):
        extra = sorted(set(n.get("required", [])) - set(o.get("required", [])))
        raise _Incompatible(path, f"makes {extra} required")
    for key in _LOWER_BOUNDS:
        if key in n and (key not in o or n[key] > o[key]):
            raise _Incompatible(f"{path}/{key}", "raises a lower bound")
    for key in _UPPER_BOUNDS:
        if key in n and (key not in o or n[key] < o[key]):
            raise _Incompatible(f"{path}/{key}", "lowers an upper bound")
    if "enum" in n and ("enum" not in o or any(v not in n["enum"] for v in o["enum"])):
        raise _Incompatible(f"{path}/enum", "drops allowed values")
    if "const" in n and o.get("const", object()) != n["const"]:
        raise _Incompatible(f"{path}/const", "changes or adds a constant")
    if "items" in n:
        if "items" not in o:
            raise _Incompatible(f"{path}/items", "adds an items restriction")
        _compat(o["items"], n["items"], f"{path}/items")
    o_props, n_props = o.get("properties", {}), n.get("properties", {})
    o_ap, n_ap = o.get("additionalProperties", True), n.get("additionalProperties", True)
    for name in sorted(set(o_props) | set(n_props)):
        old_p = o_props.get(name, o_ap)
        new_p = n_props.get(name, n_ap)
        _compat(old_p, new_p, f"{path}/properties/{name}")
    _compat(o_ap, n_ap, f"{path}/additionalProperties")
    for key in sorted(set(o) | set(n)):
        if key in handled:
            continue
        if key not in n and key in _REMOVABLE:
            continue  # dropping a pure assertion only widens
        if o.get(key) != n.get(key):
            raise _Incompatible(f"{path}/{key}", f'changes "{key}", which the compatibility check cannot prove wider')


MAX_PAYLOAD_NESTING = 256


class PayloadValidator:
    """Validates produced payloads against one schema version (compiled once)."""

    def __init__(self, topic: str, version: int, raw: bytes) -> None:
        doc = json.loads(raw)
        cls = js_validators.validator_for(doc, default=js_validators.Draft202012Validator)
        self.validator = cls(doc)
        self.uri = f"narad://schema/{topic}/{version}#"

    def check(self, payload: bytes) -> str | None:
        """None when the payload is valid; else the reason (for a 400)."""
        try:
            value = json.loads(payload)
        except (ValueError, RecursionError) as e:
            return f"schema: payload is not a single JSON text: {e}"
        if _depth(value) > MAX_PAYLOAD_NESTING:
            return f"payload nests deeper than {MAX_PAYLOAD_NESTING} levels"
        errors = []
        for err in self.validator.iter_errors(value):
            path = "/" + "/".join(str(p) for p in err.absolute_path)
            errors.append(f"- at '{path}': {err.message}")
            if len(errors) >= 5:
                break
        if not errors:
            return None
        msg = f"schema: jsonschema validation failed with '{self.uri}'\n" + "\n".join(errors)
        return msg[:2048]
