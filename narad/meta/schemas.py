"""Topic JSON Schemas: what may be registered, whether a new version is
compatible with the previous one, and bounded validation of payloads.

Registration rules: a JSON object or ``true``; at most 256 KiB; nesting at
most 64; ``$ref`` internal only (``#...``) and resolving inside the schema; a
draft from 2020-12 (default), 2019-09, 07, 06 or 04; valid against its
meta-schema (the ``jsonschema`` package). Compatibility is fail-closed and
widening-only: every document the old version accepts must still be accepted,
proven keyword by keyword; anything the checker cannot prove is refused with
the path and the reason. Annotation-only changes are "the same schema" (no new
version).

Cost limits (400 at registration), so that no schema can make validation
unbounded:
- ``pattern`` and ``patternProperties`` are RE2 syntax (google-re2: linear
  time, no catastrophic backtracking); a pattern RE2 cannot compile
  (lookaround, backreferences) is refused, and so is one whose RE2 program has
  more than MAX_REGEX_PROGRAM (4096) instructions. Every regex search
  jsonschema makes on a document (also inside additionalProperties and
  unevaluatedProperties) runs on RE2: its ``re`` is replaced by _RE2Module.
- Validation paths: each subschema may apply at most MAX_PATHS (64) times to
  one place in a document (paths counted through every applicator and every
  ``$ref``; unevaluated* counts its in-place subschemas twice); the whole
  expansion at most MAX_EXPANSION (50,000) subschema applications; at most
  MAX_SUBSCHEMAS (20,000) subschemas.
- Recursion (a ``$ref`` back to a subschema on its own path) must descend into
  the document, and may not reach the same document place twice per level (that
  cost would grow exponentially with nesting).

Validation of one payload (``PayloadValidator.check``): strict JSON (msgspec),
nesting at most 256 (400), then jsonschema with every keyword and every
subschema entered charged to a step Budget (work that grows with a subtree is
charged by its size or kept bounded: messages show a ~120-character preview of
a value, uniqueItems' canonical forms are built once): STEP_BASE +
STEPS_PER_BYTE per payload byte (over it: 400), plus a wall-clock deadline
and a cancel flag (OutOfTime; the caller answers 503).
Small payloads (<= 16 KiB, nesting <= 32) of schemas that are not ``costly``
are validated inline with at most INLINE_STEPS per message; the rest
(NeedsCapacity) run on the bounded capacity (narad.broker.validation). ``uniqueItems`` is linear
(hashing), ``format`` stays an annotation (not asserted), as before.

Pure functions and per-thread budgets; raise narad.errors.BadRequest. Touches
the ``re`` global of jsonschema's keyword modules (RE2 stand-in), nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
import urllib.parse
from typing import Any

import msgspec
import re2
from jsonschema import _format as js_format
from jsonschema import _keywords as js_keywords
from jsonschema import _legacy_keywords as js_legacy
from jsonschema import _utils as js_utils
from jsonschema import exceptions as js_exceptions
from jsonschema import validators as js_validators

from narad.errors import BadRequest

log = logging.getLogger("narad.meta.schemas")

MAX_SCHEMA_BYTES = 256 * 1024
MAX_NESTING = 64
MAX_PATHS = 64  # validation paths that may apply one subschema at one document place
MAX_EXPANSION = 50_000  # subschema applications when every $ref is expanded
MAX_ANALYSIS_OPS = 2_000_000
MAX_SUBSCHEMAS = 20_000
MAX_REGEX_PROGRAM = 4096  # RE2 instructions (the NFA's worst case per input byte)
MAX_PAYLOAD_NESTING = 256
STEP_BASE = 10_000  # keyword evaluations one payload may cost ...
STEPS_PER_BYTE = 1  # ... plus this many per payload byte (a step is ~5-15 us of CPU)
DESCEND_STEPS = 1  # entering a subschema (a new validator: about as costly as a keyword)
INLINE_STEPS = 5_000  # at most this much on the event loop at a time (per message)
INLINE_MAX_BYTES = 16 * 1024
INLINE_MAX_NESTING = 32
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
    _meta_check(cls, doc)
    analyse(doc)
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


# ---- regular expressions: RE2 only --------------------------------------------------------------

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


@functools.lru_cache(maxsize=4096)
def _re2(pattern: str) -> Any:
    """The compiled RE2 program of a pattern (raises re2.error: lookaround,
    backreferences, or a repetition RE2 refuses)."""
    return re2.compile(pattern, _RE2_OPTIONS)


class _RE2Module:
    """Stands in for the ``re`` module inside jsonschema, which calls ``re.search``
    with schema patterns on document strings (``additionalProperties`` next to
    ``patternProperties``, ``unevaluatedProperties``): every search there runs on
    RE2, linear in the input, never Python's backtracking engine."""

    error = re2.error

    @staticmethod
    def search(pattern: str, string: str) -> Any:
        return _re2(pattern).search(string)


for _mod in (js_keywords, js_utils, js_legacy):
    _mod.re = _RE2Module  # type: ignore[attr-defined]


def _regex_problem(pattern: Any) -> str | None:
    if not isinstance(pattern, str):
        return None  # the meta-schema check reports it
    try:
        prog = _re2(pattern)
    except re2.error as e:
        detail = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        return (f"is not supported: patterns use RE2 syntax, which has no lookaround or backreferences "
                f"({detail})")
    if prog.programsize > MAX_REGEX_PROGRAM:
        return (f"is too costly to match: its RE2 program has {prog.programsize} instructions "
                f"(limit {MAX_REGEX_PROGRAM}); use minLength/maxLength instead of large repetitions")
    return None


def _is_re2_regex(instance: object) -> bool:
    if isinstance(instance, str):
        _re2(instance)
    return True


def _meta_check(cls: Any, doc: Any) -> None:
    """The meta-schema check, with the ``regex`` format checked by RE2 (the
    patterns we will actually run), not by Python's ``re``."""
    fc = js_format.FormatChecker()
    fc.checkers = dict(cls.FORMAT_CHECKER.checkers)
    fc.checkers["regex"] = (_is_re2_regex, re2.error)
    meta = js_validators.validator_for(cls.META_SCHEMA, default=cls)(cls.META_SCHEMA, format_checker=fc)
    err = js_exceptions.best_match(meta.iter_errors(doc))
    if err is not None:
        path = "/" + "/".join(str(p) for p in err.absolute_path)
        if err.validator == "format" and err.validator_value == "regex":
            raise BadRequest(f"invalid argument: schema pattern {str(err.instance)[:100]!r} at {path} is not "
                             f"supported: patterns use RE2 syntax, which has no lookaround or backreferences")
        raise BadRequest(f"invalid argument: schema is not a valid JSON Schema at {path}: {err.message[:500]}")


# ---- static cost ----------------------------------------------------------------------------------
# An instance step of an edge: ("p", name) one property, ("o",) any member of an object,
# ("i", n) one array index, ("a",) any array element, ("k",) a property name. In-place
# applicators (allOf, $ref, ...) add no step.
Label = tuple[Any, ...]
_OBJ, _ARR = {"p", "o"}, {"i", "a"}


def _unescape(token: str) -> str:
    return urllib.parse.unquote(token).replace("~1", "/").replace("~0", "~")


@dataclasses.dataclass
class _Node:
    value: Any
    resource: str  # pointer of the resource root ($id) this subschema resolves "#..." against
    edges: list[tuple[str, Label | None]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Cost:
    """What registration learned about a schema's validation cost."""

    max_paths: int = 1  # most validation paths that can apply one subschema at one document place
    recursive: bool = False
    uses_unevaluated: bool = False
    uses_unique: bool = False
    largest_regex: int = 0

    @property
    def costly(self) -> bool:
        """Validated only on the bounded capacity, never inline on the event loop."""
        return self.recursive or self.uses_unevaluated or self.max_paths > 8 or self.largest_regex > 512


class _Graph:
    def __init__(self, doc: Any, legacy: bool) -> None:
        self.doc = doc
        self.legacy = legacy  # draft 04/06/07: "definitions", "dependencies", array "items"
        self.nodes: dict[str, _Node] = {}
        self.anchors: dict[tuple[str, str], str] = {}
        self.refs: list[tuple[str, str, str]] = []  # (from, keyword, ref)
        self.cost = Cost()
        self._walk("", doc, "")
        for src, kw, ref in self.refs:
            self.nodes[src].edges.append((self._resolve(src, kw, ref), None))

    def _walk(self, ptr: str, value: Any, resource: str) -> None:
        todo = [(ptr, value, resource)]
        while todo:
            p, v, res = todo.pop()
            if p in self.nodes:
                continue
            if len(self.nodes) >= MAX_SUBSCHEMAS:
                raise BadRequest(f"invalid argument: schema has more than {MAX_SUBSCHEMAS} subschemas")
            if not isinstance(v, dict):
                self.nodes[p] = _Node(v, res)
                continue
            ident = v.get("$id", v.get("id") if self.legacy else None)
            if isinstance(ident, str) and not ident.startswith("#") and p:
                res = p
            node = self.nodes[p] = _Node(v, res)
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(v.get(key), str):
                    self.anchors[(res, v[key])] = p
            if isinstance(ident, str) and ident.startswith("#") and len(ident) > 1:
                self.anchors[(res, ident[1:])] = p
            problem = _regex_problem(v.get("pattern"))
            if problem:
                raise BadRequest(f"invalid argument: schema pattern at {p}/pattern {problem}")
            for k in ("pattern",) if isinstance(v.get("pattern"), str) else ():
                self.cost.largest_regex = max(self.cost.largest_regex, _re2(v[k]).programsize)
            if isinstance(v.get("patternProperties"), dict):
                for pat in v["patternProperties"]:
                    problem = _regex_problem(pat)
                    if problem:
                        raise BadRequest(f"invalid argument: schema patternProperties key {pat[:100]!r} at "
                                         f"{p}/patternProperties {problem}")
                    self.cost.largest_regex = max(self.cost.largest_regex, _re2(pat).programsize)
            if v.get("uniqueItems") is True:
                self.cost.uses_unique = True
            if "unevaluatedProperties" in v or "unevaluatedItems" in v:
                self.cost.uses_unevaluated = True
            for kw, ref in ((k, v.get(k)) for k in ("$ref", "$dynamicRef", "$recursiveRef")):
                if isinstance(ref, str):
                    self.refs.append((p, kw, ref))
            for child, label in self._children(v):
                cp = f"{p}/{child}"
                node.edges.append((cp, label))
                todo.append((cp, self._at(v, child), res))
            for key in ("$defs", "definitions"):
                if isinstance(v.get(key), dict):
                    for name, sub in v[key].items():
                        todo.append((f"{p}/{key}/{_escape(name)}", sub, res))

    @staticmethod
    def _at(v: dict[str, Any], child: str) -> Any:
        out: Any = v
        for tok in child.split("/"):
            tok = tok.replace("~1", "/").replace("~0", "~")
            out = out[int(tok)] if isinstance(out, list) else out[tok]
        return out

    def _children(self, v: dict[str, Any]) -> list[tuple[str, Label | None]]:
        out: list[tuple[str, Label | None]] = []
        twice = "unevaluatedProperties" in v or "unevaluatedItems" in v
        for kw in ("not", "if", "then", "else"):
            if kw in v:
                out.append((kw, None))
        for kw in ("allOf", "anyOf", "oneOf"):
            if isinstance(v.get(kw), list):
                out += [(f"{kw}/{i}", None) for i in range(len(v[kw]))]
        for kw in ("dependentSchemas", "dependencies"):
            if isinstance(v.get(kw), dict):
                out += [(f"{kw}/{_escape(n)}", None) for n, s in v[kw].items() if isinstance(s, (dict, bool))]
        if twice:
            # unevaluated* evaluates the in-place subschemas again to learn what they covered
            out += [e for e in list(out) if e[1] is None]
        if isinstance(v.get("properties"), dict):
            out += [(f"properties/{_escape(n)}", ("p", n)) for n in v["properties"]]
        if isinstance(v.get("patternProperties"), dict):
            out += [(f"patternProperties/{_escape(n)}", ("o",)) for n in v["patternProperties"]]
        for kw, label in (("additionalProperties", ("o",)), ("unevaluatedProperties", ("o",)),
                          ("propertyNames", ("k",)), ("contains", ("a",)), ("unevaluatedItems", ("a",)),
                          ("additionalItems", ("a",))):
            if isinstance(v.get(kw), (dict, bool)):
                out.append((kw, label))
        if isinstance(v.get("prefixItems"), list):
            out += [(f"prefixItems/{i}", ("i", i)) for i in range(len(v["prefixItems"]))]
        items = v.get("items")
        if isinstance(items, list):
            out += [(f"items/{i}", ("i", i)) for i in range(len(items))]
        elif isinstance(items, (dict, bool)):
            out.append(("items", ("a",)))
        return out

    def _resolve(self, src: str, kw: str, ref: str) -> str:
        where = f"{src}/{kw}"
        res = self.nodes[src].resource
        frag = ref[1:] if ref.startswith("#") else None
        target: str | None = None
        if frag is not None and (frag == "" or frag.startswith("/")):
            base = self.nodes[res].value
            cur: Any = base
            ptr = res
            ok = True
            for tok in frag.split("/")[1:]:
                tok = _unescape(tok)
                if isinstance(cur, dict) and tok in cur:
                    cur = cur[tok]
                elif isinstance(cur, list) and tok.isdigit() and int(tok) < len(cur):
                    cur = cur[int(tok)]
                else:
                    ok = False
                    break
                ptr += "/" + _escape(tok)
            if ok and isinstance(cur, (dict, bool)):
                target = ptr
                if ptr not in self.nodes:
                    self._walk(ptr, cur, res)
        elif frag is not None:
            target = self.anchors.get((res, urllib.parse.unquote(frag)))
        if target is None:
            raise BadRequest(f'invalid argument: schema {kw} "{ref[:100]}" at {where} does not resolve to a '
                             f"subschema of this schema")
        return target

    def check_paths(self) -> None:
        """Count the validation paths from the root (each $ref followed; a $ref back
        to a subschema already on the path is recursion, bounded by the document)."""
        seen: dict[str, dict[tuple[Label, ...], int]] = {}
        # per recursion target: each distinct cycle (the edges taken from the target) -> its instance steps
        cycles: dict[str, dict[tuple[tuple[str, int], ...], tuple[Label, ...]]] = {}
        visits = 0
        on_path: dict[str, tuple[int, int]] = {}  # ptr -> (instance depth, stack index)
        stack: list[list[Any]] = []  # [ptr, labels, edges, next edge index]

        def enter(p: str, labels: tuple[Label, ...]) -> None:
            nonlocal visits
            visits += 1
            if visits > MAX_EXPANSION:
                raise BadRequest(f"invalid argument: schema is too costly to validate: it expands to more than "
                                 f"{MAX_EXPANSION} subschema applications")
            per = seen.setdefault(p, {})
            per[labels] = per.get(labels, 0) + 1
            on_path[p] = (len(labels), len(stack))
            stack.append([p, labels, self.nodes[p].edges, 0])

        enter("", ())
        while stack:
            top = stack[-1]
            p, labels, edges, k = top
            if k >= len(edges):
                stack.pop()
                del on_path[p]
                continue
            top[3] = k + 1
            child, label = edges[k]
            nl = (*labels, label) if label is not None else labels
            if child in on_path:
                depth, at = on_path[child]
                cyc = nl[depth:]
                if not cyc:
                    raise BadRequest(f"invalid argument: schema is too costly to validate: {child or '/'} refers "
                                     f"back to itself without descending into the document (endless recursion)")
                sig = tuple((f[0], f[3]) for f in stack[at:])
                cycles.setdefault(child, {})[sig] = cyc
                self.cost.recursive = True
                continue
            enter(child, nl)
        for p, per in seen.items():
            n = _max_compatible(per)
            self.cost.max_paths = max(self.cost.max_paths, n)
            if n > MAX_PATHS:
                raise BadRequest(f"invalid argument: schema is too costly to validate: the subschema at {p or '/'} "
                                 f"can apply {n} times to one place in a document (limit {MAX_PATHS} validation "
                                 f"paths to a subschema)")
        for p, cycs in cycles.items():
            counts: dict[tuple[Label, ...], int] = {}
            for c in cycs.values():
                counts[c] = counts.get(c, 0) + 1
            if _max_compatible(counts) > 1:
                raise BadRequest(f"invalid argument: schema is too costly to validate: the recursion into "
                                 f"{p or '/'} can apply more than once to one place in a document, so its cost "
                                 f"grows exponentially with nesting")


def _family(label: Label) -> str:
    return "obj" if label[0] in _OBJ else "arr" if label[0] in _ARR else label[0]


def _max_compatible(per: dict[tuple[Label, ...], int]) -> int:
    """Most paths that can meet at one document place (an upper bound: for each
    path, how many paths could name the same place), counted on a trie.

    The paths are walked as the trie itself (a shared prefix is walked once),
    and an exact label is looked up from the side that is smaller: the frontier
    or the trie nodes that have that label (or its wildcard) as a child. This
    keeps the analysis of a large schema near-linear (it was frontier x paths:
    seconds for 300 properties that can all meet additionalProperties)."""
    if len(per) == 1:
        return next(iter(per.values()))
    trie: dict[Any, Any] = {}
    having: dict[Label, list[tuple[dict[Any, Any], Label]]] = {}  # label -> (parent, label) in the trie
    for seq, c in per.items():
        node = trie
        for lab in seq:
            kid = node.get(lab)
            if kid is None:
                kid = node[lab] = {}
                having.setdefault(lab, []).append((node, lab))
            node = kid
        node[None] = node.get(None, 0) + c
    by_family: dict[int, dict[str, list[Any]]] = {}
    ops = 0
    best = 0
    stack: list[tuple[dict[Any, Any], list[dict[Any, Any]]]] = [(trie, [trie])]
    while stack:
        q, frontier = stack.pop()
        ids: set[int] | None = None
        for lab, qkid in q.items():
            if lab is None:
                best = max(best, sum(node.get(None, 0) for node in frontier))
                ops += len(frontier)
                continue
            nxt: list[dict[Any, Any]] = []
            if lab[0] in ("o", "a"):
                fam = _family(lab)
                for node in frontier:
                    fams = by_family.get(id(node))
                    if fams is None:
                        fams = by_family[id(node)] = {}
                        for k, v in node.items():
                            if k is not None:
                                fams.setdefault(_family(k), []).append(v)
                        ops += len(node)
                    nxt.extend(fams.get(fam, ()))
                ops += len(frontier) + len(nxt)
            else:
                wild = ("o",) if lab[0] == "p" else ("a",) if lab[0] == "i" else None
                cand = having.get(lab, []) + (having.get(wild, []) if wild is not None else [])
                if len(cand) < len(frontier):
                    if ids is None:
                        ids = {id(node) for node in frontier}
                        ops += len(frontier)
                    nxt = [parent[k] for parent, k in cand if id(parent) in ids]
                    ops += len(cand)
                else:
                    nxt = [v for node in frontier for k in (lab, wild)
                           if k is not None and (v := node.get(k)) is not None]
                    ops += 2 * len(frontier)
            if ops > MAX_ANALYSIS_OPS:
                raise BadRequest("invalid argument: schema is too costly to validate: too many paths that can "
                                 "meet at one place in a document to count")
            stack.append((qkid, nxt))
    return best


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def analyse(doc: Any) -> Cost:
    """The static cost check of a (meta-schema-valid) schema; raises BadRequest."""
    if not isinstance(doc, dict):
        return Cost()
    legacy = str(doc.get("$schema", "")).rstrip("#").startswith("http://json-schema.org/")
    g = _Graph(doc, legacy)
    g.check_paths()
    return g.cost


# ---- bounded validation ---------------------------------------------------------------------------


class Budget:
    """Steps one validation may spend (checked at every charge), a wall-clock
    deadline and a cancel flag (both checked every 8 charges and at every
    charge of more than 64 steps, so they are seen within milliseconds), and the
    memo of uniqueItems' canonical forms (by object id: the payload is alive
    and unchanged for the whole validation)."""

    __slots__ = ("cancel", "canon", "deadline", "steps", "tick")

    def __init__(self, steps: int, deadline: float = float("inf"), cancel: threading.Event | None = None) -> None:
        self.steps = steps
        self.deadline = deadline
        self.cancel = cancel
        self.tick = 0
        self.canon: dict[int, Any] = {}


class OverBudget(Exception):
    """The validation spent its step budget."""


class OutOfTime(Exception):
    """The validation passed its deadline, or its request was canceled."""


_tls = threading.local()


def _charge(n: int) -> None:
    b: Budget = _tls.budget
    b.steps -= n
    if b.steps < 0:
        raise OverBudget
    b.tick += 1
    if (not b.tick & 7 or n > 64) and (time.monotonic() > b.deadline or (b.cancel is not None and b.cancel.is_set())):
        raise OutOfTime


def _size(instance: Any) -> int:
    return len(instance) if isinstance(instance, (str, list, dict)) else 0


def _charged(fn: Any) -> Any:
    def run(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _charge(1 + (_size(instance) >> 4))
        return fn(validator, value, instance, schema)

    return run


class _SchemaUnusable(Exception):
    """The registered schema cannot be evaluated safely (a pattern RE2 refuses)."""


def _pattern(validator: Any, patrn: Any, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string"):
        _charge(1 + (len(instance) >> 6))
        try:
            prog = _re2(patrn)
        except re2.error:
            raise _SchemaUnusable(f"pattern {patrn[:100]!r} is not RE2 syntax") from None
        if not prog.search(instance):
            yield js_exceptions.ValidationError(f"{instance[:100]!r} does not match {patrn[:200]!r}")


def _pattern_properties(validator: Any, pp: Any, instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    _charge(1 + len(pp) * len(instance))
    for pat, sub in pp.items():
        try:
            prog = _re2(pat)
        except re2.error:
            raise _SchemaUnusable(f"patternProperties key {pat[:100]!r} is not RE2 syntax") from None
        for k, v in instance.items():
            if prog.search(k):
                yield from validator.descend(v, sub, path=k, schema_path=pat)


def _canon(v: Any) -> Any:
    """A hashable form with JSON equality: 1 == 1.0, true != 1, key order ignored.

    A container's form is computed once per validation (memo on the Budget) and
    charged by its length: uniqueItems at every level of a nested array costs
    the subtree once, not once per level (that was depth x size, uncharged)."""
    if isinstance(v, bool) or v is None:
        return ("b", v)
    if isinstance(v, (int, float)):
        return ("n", int(v) if isinstance(v, float) and v.is_integer() else v)
    if isinstance(v, str):
        return ("s", v)
    memo = _tls.budget.canon
    c = memo.get(id(v))
    if c is None:
        _charge(1 + (len(v) >> 4))
        if isinstance(v, list):
            c = _Canon(("l", tuple(_canon(x) for x in v)), len(v))
        else:
            c = _Canon(("d", frozenset((k, _canon(x)) for k, x in v.items())), len(v))
        memo[id(v)] = c
    return c


class _Canon:
    """A container's canonical form with its hash computed once (a tuple's hash
    is recomputed at every use: at every level, the whole subtree again);
    comparing two with equal hashes is charged by their length."""

    __slots__ = ("form", "hash", "size")

    def __init__(self, form: tuple[Any, ...], size: int) -> None:
        self.form = form
        self.size = size
        self.hash = hash(form)  # the children's hashes are cached: O(len)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Canon) or self.hash != other.hash:
            return False
        _charge(1 + (min(self.size, other.size) >> 4))
        return self.form == other.form


def _unique_items(validator: Any, ui: Any, instance: Any, schema: Any) -> Any:
    if ui and validator.is_type(instance, "array"):
        _charge(1 + (len(instance) >> 4))
        seen: set[Any] = set()
        for x in instance:
            c = _canon(x)
            if c in seen:
                yield js_exceptions.ValidationError("array has non-unique elements")
                return
            seen.add(c)


def _count_charged(fn: Any, key: str) -> Any:
    def run(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _charge(1 + (len(value) if key == "value" and isinstance(value, list) else _size(instance)))
        return fn(validator, value, instance, schema)

    return run


_CLASSES: dict[Any, Any] = {}


def _budgeted(base: Any) -> Any:
    """``base`` with every keyword charged to the thread's Budget, and pattern,
    patternProperties and uniqueItems replaced by linear-time versions."""
    cls = _CLASSES.get(base)
    if cls is None:
        kws = {k: _charged(fn) for k, fn in base.VALIDATORS.items()}
        if "pattern" in kws:
            kws["pattern"] = _pattern
        if "patternProperties" in kws:
            kws["patternProperties"] = _pattern_properties
        if "uniqueItems" in kws:
            kws["uniqueItems"] = _unique_items
        for k in ("enum", "required", "dependentRequired"):
            if k in base.VALIDATORS:
                kws[k] = _count_charged(base.VALIDATORS[k], "value")
        for k in ("additionalProperties", "unevaluatedProperties", "unevaluatedItems"):
            if k in base.VALIDATORS:
                kws[k] = _count_charged(base.VALIDATORS[k], "instance")
        cls = js_validators.extend(base, kws)
        plain = cls.descend

        def descend(self: Any, instance: Any, schema: Any, path: Any = None, schema_path: Any = None,
                    resolver: Any = None) -> Any:
            # entering a subschema (a new validator, its keywords looked up) was not charged: an
            # anyOf of many small branches cost ~13 us per step, past the deadline (503) before the
            # budget ran out (400)
            _charge(DESCEND_STEPS)
            return plain(self, instance, schema, path=path, schema_path=schema_path, resolver=resolver)

        cls.descend = descend
        _CLASSES[base] = cls
    return cls


class NeedsCapacity(Exception):
    """Inline validation ran out of its small allowance: run it on the capacity."""


def _reason_nesting() -> str:
    return f"payload nests deeper than {MAX_PAYLOAD_NESTING} levels"


class PayloadValidator:
    """Validates produced payloads against one schema version (compiled once).

    ``check`` parses and validates one payload under a Budget; it raises
    NeedsCapacity (inline only), OutOfTime, or returns None / the 400 reason."""

    def __init__(self, topic: str, version: int, raw: bytes) -> None:
        doc = json.loads(raw)
        base = js_validators.validator_for(doc, default=js_validators.Draft202012Validator)
        # The schema's values too are shown as a preview in messages (const, enum, not, ...):
        # a 200 KB const or subschema was repr'd at every level of a recursive schema.
        self.validator = _budgeted(base)(_wrap(doc))
        self.uri = f"narad://schema/{topic}/{version}#"
        self.unusable: str | None = None
        try:
            self.cost = analyse(doc)
        except BadRequest as e:
            # Registered before these limits: still validated, under the budget, never inline.
            self.cost = Cost(max_paths=MAX_PATHS + 1)
            if "RE2" in e.message:
                self.unusable = e.message.removeprefix("invalid argument: ")
        self.version = version

    def inline_ok(self, payload: bytes) -> bool:
        return len(payload) <= INLINE_MAX_BYTES and not self.cost.costly

    def check(self, payload: bytes, *, inline: bool, deadline: float = float("inf"),
              cancel: threading.Event | None = None) -> str | None:
        if self.unusable is not None:
            return f"schema: version {self.version} of this topic's schema cannot be used: {self.unusable}; " \
                   f"register a new version"
        try:
            value = _decode(payload)
        except RecursionError:
            return _reason_nesting()
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            return f"schema: payload is not a single JSON text: {e}"
        depth = _depth(value, limit=MAX_PAYLOAD_NESTING + 1)
        if depth > MAX_PAYLOAD_NESTING:
            return _reason_nesting()
        if inline and depth > INLINE_MAX_NESTING:
            raise NeedsCapacity
        value = _wrap(value)
        full = STEP_BASE + STEPS_PER_BYTE * len(payload)
        b = Budget(min(full, INLINE_STEPS) if inline else full, deadline, cancel)
        prev = getattr(_tls, "budget", None)
        _tls.budget = b
        errors: list[str] = []
        try:
            for err in self.validator.iter_errors(value):
                path = "/" + "/".join(str(p) for p in err.absolute_path)
                errors.append(f"- at '{path}': {err.message}")
                if len(errors) >= 5:
                    break
        except OverBudget:
            if inline and full > INLINE_STEPS:
                raise NeedsCapacity from None
            return (f"schema: validating this payload costs more than {full} steps "
                    f"({STEP_BASE} + {STEPS_PER_BYTE} per payload byte); simplify the payload or the schema")
        except RecursionError:
            return f"schema: payload nests too deeply for this schema's recursion (limit {MAX_PAYLOAD_NESTING})"
        except _SchemaUnusable as e:
            return f"schema: version {self.version} of this topic's schema cannot be used: {e}; register a new version"
        except (js_exceptions._WrappedReferencingError, re2.error) as e:
            return f"schema: version {self.version} of this topic's schema cannot be used: {str(e)[:200]}"
        except (OutOfTime, NeedsCapacity):
            raise
        except Exception:
            log.exception("schema validation failed unexpectedly", extra={"schema": self.uri})
            return f"schema: this payload could not be validated against '{self.uri}' (the error is logged)"
        finally:
            _tls.budget = prev
        if not errors:
            return None
        msg = f"schema: jsonschema validation failed with '{self.uri}'\n" + "\n".join(errors)
        return msg[:2048]


_decoder = msgspec.json.Decoder()
_PREVIEW = 120  # characters of a payload value an error message shows


class _Full(Exception):
    pass


def _preview(v: Any) -> str:
    """At most ~_PREVIEW characters of repr(v): the cost of an error message no
    longer grows with the subtree (jsonschema builds every message eagerly, also
    the ones anyOf/oneOf/not/if discard; at every level of a nested payload that
    was depth x size of repr, uncharged)."""
    out: list[str] = []
    used = 0

    def emit(text: str) -> None:
        nonlocal used
        out.append(text)
        used += len(text)
        if used > _PREVIEW:
            raise _Full

    def walk(x: Any) -> None:
        if isinstance(x, list):
            emit("[")
            for i, y in enumerate(x):
                emit(", " if i else "")
                walk(y)
            emit("]")
        elif isinstance(x, dict):
            emit("{")
            for i, (k, y) in enumerate(x.items()):
                emit(", " if i else "")
                emit(str.__repr__(k[:_PREVIEW]) + ": ")
                walk(y)
            emit("}")
        elif isinstance(x, str):
            emit(str.__repr__(x[:_PREVIEW]))
        else:
            emit(repr(x))

    try:
        walk(v)
    except _Full:
        return "".join(out)[:_PREVIEW] + "..."
    return "".join(out)


class _JList(list):  # type: ignore[type-arg]
    """A payload array whose repr is a short preview."""

    __slots__ = ()
    __repr__ = _preview


class _JDict(dict):  # type: ignore[type-arg]
    """A payload object whose repr is a short preview."""

    __slots__ = ()
    __repr__ = _preview


class _JStr(str):
    """A long payload string whose repr is a short preview."""

    __slots__ = ()
    __repr__ = _preview


def _wrap(v: Any) -> Any:
    """The decoded payload with containers (and long strings) whose repr is
    bounded; one linear pass (nesting is already checked)."""
    if isinstance(v, list):
        return _JList([_wrap(x) for x in v])
    if isinstance(v, dict):
        return _JDict({k: _wrap(x) for k, x in v.items()})
    if isinstance(v, str) and len(v) > _PREVIEW:
        return _JStr(v)
    return v


def _decode(payload: bytes) -> Any:
    """Strict JSON (UTF-8, no BOM, no NaN, no trailing data)."""
    return _decoder.decode(payload)
