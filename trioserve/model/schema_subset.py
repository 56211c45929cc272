"""The part of JSON Schema that trioserve enforces token by token, normalized for the converter.

Owns one decision: whether a JSON Schema can be turned into a grammar whose every output
validates against it. A schema passes through :class:`Normalizer`, which returns an
equivalent (or strictly narrower) schema written only with the constructs the GBNF converter
handles correctly (``core/constraints.py`` loads the converter), or raises :class:`SchemaUnsupported`
naming the keyword by its path. It never drops a constraint: anything it cannot express is an
error, so a client is never given output that silently ignores part of its schema.

Narrowing is allowed (output still validates), widening never. The narrowings, all documented
in spec/README.md §5.6: an object with declared ``properties`` gets no other keys, whatever
``additionalProperties`` allows; whitespace is compact; a pattern's ``.`` and
character classes never produce ``"``, ``\\`` or control characters (they would need JSON
escapes; a *literal* such character in a pattern is emitted escaped and is supported).

Supported (everything else is rejected):

- ``type`` (one or a list), ``const``, ``enum`` (with ``type``: values of other types removed);
- objects: ``properties``, ``required`` (⊆ properties), ``additionalProperties`` (bool or schema);
- arrays: ``items``, ``prefixItems`` (or a list ``items``), ``minItems``/``maxItems``;
- strings: ``minLength``/``maxLength``, or ``pattern``, or ``format`` ∈ date, time, date-time,
  uuid — one of the three per string (the converter applies only one);
- integers: ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum`` when they bound a
  finite range of at most :data:`MAX_INT_RANGE` values (enforced as an enumeration, the
  converter itself ignores numeric bounds), ``multipleOf`` inside such a range;
- ``anyOf``; ``oneOf`` when its alternatives are provably exclusive (distinct JSON types,
  disjoint constants, or a required ``const``/``enum`` discriminator property), because a
  grammar can only make output match *at least* one alternative;
- ``allOf`` with exactly one subschema; ``$ref`` to ``#`` or ``#/json/pointer`` (recursion
  allowed when it passes through an object or array);
- annotations (``title``, ``description``, ``default``, ``examples``, ``$comment``, ``$schema``,
  ``$id``, ``deprecated``, ``readOnly``, ``writeOnly``, ``discriminator``, ``x-*``) are ignored.

Pure and synchronous; the size caps (:data:`MAX_DEPTH`, :data:`MAX_REPEAT`,
:data:`REPEAT_BUDGET`, :data:`MAX_ENUM_VALUES`, :data:`ALTERNATIVES_BUDGET`) bound the work,
the grammar size and the sampler's per-token cost before conversion starts.
"""

from __future__ import annotations

import json
import math
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Iterable

from trioserve.model.json_patterns import MAX_REPEAT, rewrite_pattern
from trioserve import limits, strict_json
from trioserve.strict_json import json_type_name

__all__ = [
    "SchemaUnsupported",
    "Normalizer",
    "ANY_VALUE",
    "MAX_INT_RANGE",
    "MAX_DEPTH",
    "MAX_ENUM_VALUES",
    "ALTERNATIVES_BUDGET",
]

MAX_INT_RANGE = 256  # integer ranges become enumerations; more alternatives slow sampling
REPEAT_BUDGET = 20_000  # the sum of all repetition bounds in one request
MAX_DEPTH = 64  # nesting of subschemas (the converter recurses per level)
# The worker's grammar sampler keeps one parse stack per live alternative and checks every
# candidate token against each, so an enum's cost per generated token grows with its size —
# and that step is shared by every stream in the batch (found by a hostile test: 20,000 values took 32 s and
# stalled everyone). Measured in bench/hostile_bench.py (numbers in spec §5.6).
MAX_ENUM_VALUES = 256  # values of one enum (the same bound as an enumerated integer range)
ALTERNATIVES_BUDGET = 1024  # enum values, enumerated integers and anyOf/oneOf branches, summed

# Every JSON value: the converter turns a type list into a union of its primitive rules.
# (It would turn an empty schema into "any object" only.)
ANY_VALUE: dict[str, Any] = {"type": ["object", "array", "string", "number", "boolean", "null"]}

_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
    "readOnly", "writeOnly", "discriminator", "$defs", "definitions",
})
_OBJECT_KEYS = ("properties", "required", "additionalProperties")
_ARRAY_KEYS = ("items", "prefixItems", "minItems", "maxItems", "uniqueItems")
_STRING_KEYS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_KIND_KEYS = {"object": _OBJECT_KEYS, "array": _ARRAY_KEYS, "string": _STRING_KEYS,
              "number": _NUMBER_KEYS, "integer": _NUMBER_KEYS}
_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref")
_KNOWN = (_ANNOTATIONS | frozenset(("type", "const", "enum")) | frozenset(_COMBINATORS)
          | frozenset(k for keys in _KIND_KEYS.values() for k in keys))
# Known keywords we deliberately do not enforce, with the reason given to the client.
_REJECTED = {
    "not": "'not' cannot be expressed as a grammar",
    "if": "conditionals (if/then/else) are not supported",
    "then": "conditionals (if/then/else) are not supported",
    "else": "conditionals (if/then/else) are not supported",
    "patternProperties": "patternProperties is not supported; list the properties",
    "propertyNames": "propertyNames is not supported",
    "minProperties": "minProperties is not supported; use required",
    "maxProperties": "maxProperties is not supported; use additionalProperties: false",
    "dependentRequired": "dependentRequired is not supported",
    "dependentSchemas": "dependentSchemas is not supported",
    "dependencies": "dependencies is not supported",
    "unevaluatedProperties": "unevaluatedProperties is not supported; use additionalProperties",
    "unevaluatedItems": "unevaluatedItems is not supported",
    "contains": "contains is not supported",
    "minContains": "minContains is not supported",
    "maxContains": "maxContains is not supported",
    "additionalItems": "additionalItems is not supported; use prefixItems",
    "contentEncoding": "contentEncoding is not supported",
    "contentMediaType": "contentMediaType is not supported",
    "$anchor": "anchors are not supported; use $ref with a JSON pointer (#/$defs/...)",
    "$dynamicRef": "$dynamicRef is not supported",
    "$dynamicAnchor": "$dynamicAnchor is not supported",
    "$recursiveRef": "$recursiveRef is not supported",
    "nullable": "'nullable' is not JSON Schema; use \"type\": [..., \"null\"]",
}
_FORMATS = ("date", "time", "date-time", "uuid")


class SchemaUnsupported(Exception):
    """The schema (or part of it) cannot be enforced. ``path`` is relative to the schema root
    (``properties.age.minimum``; ``""`` for the root), ``reason`` says why and what to send."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path or '<root>'}: {reason}")
        self.path = path
        self.reason = reason


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _json_type(value: Any) -> str:
    """The JSON Schema type of a decoded JSON value (an integral float is an integer)."""
    if isinstance(value, float) and value.is_integer():
        return "integer"
    return json_type_name(value)


def _matches_type(value: Any, types: Iterable[str]) -> bool:
    t = _json_type(value)
    return any(t == want or (t == "integer" and want == "number") for want in types)


def _canonical(value: Any) -> str:
    """Equality key for JSON values as JSON Schema compares them (1 == 1.0, keys unordered)."""
    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return json.dumps(norm(value), sort_keys=True)


def _count(value: Any, path: str) -> int:
    """A non-negative integer bound (minItems, maxLength, …) within MAX_REPEAT."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaUnsupported(path, "must be a non-negative integer")
    if value > MAX_REPEAT:
        raise SchemaUnsupported(path, f"bounds above {MAX_REPEAT} cannot be enforced")
    return value


@dataclass
class Normalizer:
    """Normalizes schema documents into one converter input.

    Call :meth:`add` once per document (a response schema, each tool's ``parameters``); each
    returns that document's normalized root. Every ``$ref`` target becomes a definition in
    :attr:`defs` named ``def-N`` and every ``$ref`` points at ``#/$defs/def-N``, so the
    converter resolves them from one root document (``{"$defs": defs, ...}``) and its rule
    names cannot collide with rules derived from property names (the converter names a ref's
    rule by its last pointer segment and would silently reuse an existing rule of that name).
    """

    defs: dict[str, Any] = field(default_factory=dict)
    _names: dict[tuple[int, str], str] = field(default_factory=dict)
    _in_progress: set[str] = field(default_factory=set)
    _documents: list[Any] = field(default_factory=list)
    _repeat_total: int = 0
    _alternatives_total: int = 0

    def add(self, schema: Any) -> Any:
        """Normalize one document; raises SchemaUnsupported (paths relative to its root)."""
        self._documents.append(schema)
        doc = len(self._documents) - 1
        try:
            return self._node(schema, "", doc, frozenset(), 0)
        except RecursionError:  # bounded by MAX_DEPTH, but be certain it is never a 500
            raise SchemaUnsupported("", f"nested deeper than {MAX_DEPTH} levels") from None

    # -- dispatch -------------------------------------------------------------------------

    def _node(self, node: Any, path: str, doc: int, guard: frozenset[str], depth: int) -> Any:
        """Normalize one subschema. ``guard`` holds the definitions entered since the last
        object or array: meeting one again would be a left-recursive grammar (a schema that
        only refers to itself), which has no finite output."""
        if depth > MAX_DEPTH:
            raise SchemaUnsupported(path, f"nested deeper than {MAX_DEPTH} levels")
        if node is True:
            return ANY_VALUE
        if node is False:
            raise SchemaUnsupported(path, "the schema 'false' allows no value here")
        if not isinstance(node, dict):
            raise SchemaUnsupported(path, "a schema must be an object or a boolean")
        for key in node:
            if key in _REJECTED:
                raise SchemaUnsupported(_join(path, key), _REJECTED[key])
            if key not in _KNOWN and not key.startswith("x-"):
                raise SchemaUnsupported(_join(path, key), f"unknown keyword {key!r}")
        for key in ("$defs", "definitions"):
            if key in node and not isinstance(node[key], dict):
                raise SchemaUnsupported(_join(path, key), "must be an object of schemas")
        depth += 1
        if "$ref" in node:
            self._only(node, path, "$ref")
            return self._ref(node["$ref"], _join(path, "$ref"), doc, guard, depth)
        if "allOf" in node:
            self._only(node, path, "allOf")
            parts = node["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise SchemaUnsupported(_join(path, "allOf"),
                                        "only an allOf with exactly one schema is supported")
            return self._node(parts[0], _join(path, "allOf[0]"), doc, guard, depth)
        if "anyOf" in node or "oneOf" in node:
            key = "oneOf" if "oneOf" in node else "anyOf"
            self._only(node, path, key)
            return self._union(node[key], _join(path, key), doc, guard, depth, one_of=key == "oneOf")
        types = self._types(node, path)
        if "const" in node or "enum" in node:
            return self._constant(node, path, types)
        if types is None:
            types = self._infer_type(node, path)
        if types is None:
            return ANY_VALUE
        if len(types) > 1:
            branches = [self._typed(node, t, path, doc, depth) for t in types]
            return {"anyOf": branches}
        return self._typed(node, types[0], path, doc, depth)

    def _only(self, node: dict[str, Any], path: str, keyword: str) -> None:
        """``keyword`` must stand alone, annotations aside (the converter ignores siblings)."""
        for key in node:
            if key != keyword and key not in _ANNOTATIONS and not key.startswith("x-"):
                raise SchemaUnsupported(_join(path, key), f"cannot be combined with {keyword}; "
                                        f"move it into the {keyword} subschemas")

    def _types(self, node: dict[str, Any], path: str) -> list[str] | None:
        if "type" not in node:
            return None
        raw = node["type"]
        listed = raw if isinstance(raw, list) else [raw]
        if not listed or any(t not in _TYPES for t in listed) or len(set(listed)) != len(listed):
            raise SchemaUnsupported(_join(path, "type"),
                                    f"must be one of {', '.join(_TYPES)} or a list of distinct ones")
        if "integer" in listed and "number" in listed:
            listed = [t for t in listed if t != "integer"]  # every integer is a number
        return listed

    def _infer_type(self, node: dict[str, Any], path: str) -> list[str] | None:
        kinds = [kind for kind, keys in _KIND_KEYS.items() if kind != "integer"
                 and any(k in node for k in keys)]
        if len(kinds) > 1:
            raise SchemaUnsupported(path, f"keywords of several types ({', '.join(kinds)}) "
                                    "without a 'type': add one")
        return kinds or None

    # -- constants --------------------------------------------------------------------------

    def _constant(self, node: dict[str, Any], path: str, types: list[str] | None) -> Any:
        extra = [k for k in node if k not in _ANNOTATIONS and k not in ("type", "const", "enum")
                 and not k.startswith("x-")]
        if extra:
            raise SchemaUnsupported(_join(path, extra[0]),
                                    "cannot be combined with const/enum; list only valid values")
        if "const" in node and "enum" in node:
            raise SchemaUnsupported(_join(path, "enum"), "use either const or enum, not both")
        if "const" in node:
            if types is not None and not _matches_type(node["const"], types):
                raise SchemaUnsupported(_join(path, "const"), "the value does not match 'type'")
            return {"const": node["const"]}
        values = node["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaUnsupported(_join(path, "enum"), "must be a non-empty array")
        if len(values) > MAX_ENUM_VALUES:
            raise SchemaUnsupported(_join(path, "enum"), f"an enum of {len(values)} values is over "
                                    f"the limit of {MAX_ENUM_VALUES} values per enum")
        self._alternatives(len(values), _join(path, "enum"))
        if types is not None:
            # Values of another type can never validate: removing them is exact.
            values = [v for v in values if _matches_type(v, types)]
            if not values:
                raise SchemaUnsupported(_join(path, "enum"), "no value matches 'type'")
        return {"enum": values}

    # -- typed schemas ----------------------------------------------------------------------

    def _typed(self, node: dict[str, Any], kind: str, path: str, doc: int, depth: int) -> Any:
        """``node`` restricted to values of type ``kind``; keywords for other types do not
        apply to such values and are dropped (exact)."""
        if kind == "object":
            return self._object(node, path, doc, depth)
        if kind == "array":
            return self._array(node, path, doc, depth)
        if kind == "string":
            return self._string(node, path)
        if kind in ("integer", "number"):
            return self._number(node, kind, path)
        return {"type": kind}

    def _object(self, node: dict[str, Any], path: str, doc: int, depth: int) -> Any:
        props = node.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaUnsupported(_join(path, "properties"), "must be an object of schemas")
        ppath = _join(path, "properties")
        # An object consumes "{": recursion below it is not left recursion.
        out_props = {name: self._node(sub, _join(ppath, name), doc, frozenset(), depth)
                     for name, sub in props.items()}
        required = node.get("required", [])
        rpath = _join(path, "required")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaUnsupported(rpath, "must be an array of property names")
        if len(set(required)) != len(required):
            raise SchemaUnsupported(rpath, "lists a property twice")
        for i, name in enumerate(required):
            if name not in props:
                raise SchemaUnsupported(_join(rpath, i), f"'{name}' is required but not in "
                                        "properties; declare it so the output can contain it")
        extra = node.get("additionalProperties", True)
        # With declared properties, extra keys (always optional) are never generated, so
        # "declared keys only" validates. It is also needed: the converter's rule for an extra
        # key accepts any string, a declared name included, and a repeated key's last value
        # (the one a parser keeps) would escape that property's schema.
        # An explicitly empty "properties" (a parameterless tool) is read the same way, as
        # OpenAI's strict mode does: no keys at all, unless additionalProperties says more.
        # Otherwise a forced call to such a tool could wander inside an invented key until
        # the token budget ends.
        declared_empty = "properties" in node and "additionalProperties" not in node
        if props or extra is False or declared_empty:
            additional: Any = False
        else:
            additional = self._node(extra, _join(path, "additionalProperties"), doc,
                                    frozenset(), depth)
            if additional == ANY_VALUE:
                return {"type": "object"}  # the converter's "any object" rule
        return {"type": "object", "properties": out_props, "required": list(required),
                "additionalProperties": additional}

    def _array(self, node: dict[str, Any], path: str, doc: int, depth: int) -> Any:
        if node.get("uniqueItems") not in (None, False):
            raise SchemaUnsupported(_join(path, "uniqueItems"), "uniqueItems is not supported")
        lo = self._repeat(node.get("minItems", 0), _join(path, "minItems"))
        hi = node.get("maxItems")
        if hi is not None:
            hi = self._repeat(hi, _join(path, "maxItems"))
            if hi < lo:
                raise SchemaUnsupported(_join(path, "maxItems"), "is below minItems")
        items = node.get("items")
        prefix = node.get("prefixItems")
        if isinstance(items, list):  # draft-4 tuple form
            prefix, items, prefix_key = items, None, "items"
        else:
            prefix_key = "prefixItems"
        if prefix is not None:
            if not isinstance(prefix, list):
                raise SchemaUnsupported(_join(path, prefix_key), "must be an array of schemas")
            # The converter emits exactly the prefix: valid when its length is allowed.
            if not lo <= len(prefix) <= (hi if hi is not None else len(prefix)):
                raise SchemaUnsupported(_join(path, prefix_key), "a tuple whose length is "
                                        "outside minItems/maxItems cannot be enforced")
            tuple_items = [self._node(s, _join(_join(path, prefix_key), i), doc, frozenset(), depth)
                           for i, s in enumerate(prefix)]
            return {"type": "array", "prefixItems": tuple_items}
        if items is False:
            if lo > 0:
                raise SchemaUnsupported(_join(path, "items"), "false allows no items")
            return {"type": "array", "prefixItems": []}
        item = ANY_VALUE if items is None else self._node(
            items, _join(path, "items"), doc, frozenset(), depth)
        out: dict[str, Any] = {"type": "array", "items": item, "minItems": lo}
        if hi is not None:
            out["maxItems"] = hi
        return out

    def _string(self, node: dict[str, Any], path: str) -> Any:
        groups = [g for g, keys in (("pattern", ("pattern",)), ("format", ("format",)),
                                    ("length", ("minLength", "maxLength")))
                  if any(k in node for k in keys)]
        if len(groups) > 1:
            second = ("format",) if groups[1] == "format" else ("minLength", "maxLength")
            key = next(k for k in second if k in node)
            raise SchemaUnsupported(_join(path, key), f"cannot be combined with "
                                    f"{groups[0]} on one string (only one is enforced); "
                                    "fold it into the pattern")
        if "pattern" in node:
            pattern = node["pattern"]
            if not isinstance(pattern, str):
                raise SchemaUnsupported(_join(path, "pattern"), "must be a string")
            if len(pattern) > limits.MAX_PATTERN_CHARS:  # checked before re compiles (and caches) it
                raise SchemaUnsupported(_join(path, "pattern"), f"a pattern of {len(pattern)} "
                                        f"characters is over the limit of {limits.MAX_PATTERN_CHARS}")
            try:
                rewritten, repeats = rewrite_pattern(pattern)
            except ValueError as exc:
                raise SchemaUnsupported(_join(path, "pattern"), str(exc)) from None
            self._spend(repeats, _join(path, "pattern"))
            return {"type": "string", "pattern": rewritten}
        if "format" in node:
            fmt = node["format"]
            if fmt not in _FORMATS:
                raise SchemaUnsupported(_join(path, "format"), f"format {fmt!r} cannot be "
                                        f"enforced; supported: {', '.join(_FORMATS)}")
            return {"type": "string", "format": fmt}
        lo = self._repeat(node.get("minLength", 0), _join(path, "minLength"))
        hi = node.get("maxLength")
        if hi is not None:
            hi = self._repeat(hi, _join(path, "maxLength"))
            if hi < lo:
                raise SchemaUnsupported(_join(path, "maxLength"), "is below minLength")
        if lo == 0 and hi is None:
            return {"type": "string"}
        out: dict[str, Any] = {"type": "string", "minLength": lo}
        if hi is not None:
            out["maxLength"] = hi
        return out

    def _number(self, node: dict[str, Any], kind: str, path: str) -> Any:
        bounds = [k for k in _NUMBER_KEYS if k in node]
        if not bounds:
            return {"type": kind}
        for key in bounds:
            value = node[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SchemaUnsupported(_join(path, key), "must be a finite number")
        if kind == "number":
            raise SchemaUnsupported(_join(path, bounds[0]), "bounds on a 'number' cannot be "
                                    "enforced by the grammar; use an integer with both bounds "
                                    f"(at most {MAX_INT_RANGE} values) or an enum")
        lo = -math.inf
        if "minimum" in node:
            lo = math.ceil(node["minimum"])
        if "exclusiveMinimum" in node:
            lo = max(lo, math.floor(node["exclusiveMinimum"]) + 1)
        hi = math.inf
        if "maximum" in node:
            hi = math.floor(node["maximum"])
        if "exclusiveMaximum" in node:
            hi = min(hi, math.ceil(node["exclusiveMaximum"]) - 1)
        if math.isinf(lo) or math.isinf(hi):
            missing = "maximum" if math.isinf(hi) else "minimum"
            raise SchemaUnsupported(_join(path, bounds[0]), f"integer bounds are enforced only "
                                    f"as a finite range: add '{missing}' (at most "
                                    f"{MAX_INT_RANGE} values in all)")
        if hi < lo:
            raise SchemaUnsupported(_join(path, bounds[0]), "the bounds allow no integer")
        if hi - lo + 1 > MAX_INT_RANGE:
            raise SchemaUnsupported(_join(path, bounds[0]), f"an integer range of {hi - lo + 1} "
                                    f"values is too large to enforce (at most {MAX_INT_RANGE})")
        values = list(range(int(lo), int(hi) + 1))
        if "multipleOf" in node:
            step = node["multipleOf"]
            if step <= 0:
                raise SchemaUnsupported(_join(path, "multipleOf"), "must be positive")
            values = [v for v in values if math.isclose(v / step, round(v / step), abs_tol=1e-9)]
            if not values:
                raise SchemaUnsupported(_join(path, "multipleOf"), "no integer in range is a multiple")
        # The converter has no numeric bounds; an enumeration of the range is exact.
        self._alternatives(len(values), path)
        return {"enum": values}

    def _repeat(self, value: Any, path: str) -> int:
        n = _count(value, path)
        self._spend(n, path)
        return n

    def _alternatives(self, n: int, path: str) -> None:
        self._alternatives_total += n
        if self._alternatives_total > ALTERNATIVES_BUDGET:
            raise SchemaUnsupported(path, f"the schemas' enum values, enumerated integers and "
                                    f"anyOf/oneOf alternatives add up to more than "
                                    f"{ALTERNATIVES_BUDGET}, the limit per request")

    def _spend(self, n: int, path: str) -> None:
        self._repeat_total += n
        if self._repeat_total > REPEAT_BUDGET:
            raise SchemaUnsupported(path, f"the repetition bounds add up to more than "
                                    f"{REPEAT_BUDGET}; the grammar would be too large")

    # -- unions and references ----------------------------------------------------------------

    def _union(self, alts: Any, path: str, doc: int, guard: frozenset[str], depth: int,
               *, one_of: bool) -> Any:
        if not isinstance(alts, list) or not alts:
            raise SchemaUnsupported(path, "must be a non-empty array of schemas")
        self._alternatives(len(alts), path)
        out = [self._node(a, _join(path, i), doc, guard, depth) for i, a in enumerate(alts)]
        if one_of and len(out) > 1 and not self._exclusive(out):
            raise SchemaUnsupported(path, "oneOf alternatives that can match the same value "
                                    "cannot be enforced (a grammar only ensures at least one "
                                    "matches); use anyOf, or make them differ by type or by a "
                                    "required const property")
        return out[0] if len(out) == 1 else {"anyOf": out}

    def _ref(self, ref: Any, path: str, doc: int, guard: frozenset[str], depth: int) -> Any:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaUnsupported(path, "only local references ('#' or '#/json/pointer') "
                                    "are supported")
        key = (doc, ref)
        name = self._names.get(key)
        if name is not None:
            if name in guard:
                raise SchemaUnsupported(path, "a reference that refers back to itself without "
                                        "an object or array in between has no finite value")
            return {"$ref": f"#/$defs/{name}"}
        target = self._documents[doc]
        tpath = ""
        for raw in ref[2:].split("/") if ref != "#" else []:
            token = urllib.parse.unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif isinstance(target, list) and (index := strict_json.ascii_digits(
                    token, max_digits=len(str(len(target))))) is not None and index < len(target):
                target = target[index]  # JSON Pointer indexes are ASCII digits (RFC 6901)
            else:
                raise SchemaUnsupported(path, f"reference {ref!r} does not resolve")
            tpath = _join(tpath, token)
        name = f"def-{len(self._names)}"
        self._names[key] = name
        self._in_progress.add(name)
        self.defs[name] = self._node(target, tpath, doc, guard | {name}, depth)
        self._in_progress.discard(name)
        return {"$ref": f"#/$defs/{name}"}

    def _value_types(self, schema: Any, seen: frozenset[str] = frozenset()) -> set[str]:
        """JSON types a normalized schema can produce (integer counted as number)."""
        everything = {"object", "array", "string", "number", "boolean", "null"}
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            if name in seen or name in self._in_progress:
                return everything
            return self._value_types(self.defs[name], seen | {name})
        if "anyOf" in schema:
            return set().union(*(self._value_types(s, seen) for s in schema["anyOf"]))
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            return {"number" if _json_type(v) == "integer" else _json_type(v) for v in values}
        types = schema.get("type")
        if types is None:
            return everything
        types = types if isinstance(types, list) else [types]
        return {"number" if t == "integer" else t for t in types}

    def _constants(self, schema: Any) -> set[str] | None:
        """The canonical values a constant schema allows, or None if not a constant."""
        if "const" in schema:
            return {_canonical(schema["const"])}
        if "enum" in schema:
            return {_canonical(v) for v in schema["enum"]}
        return None

    def _resolved(self, schema: Any) -> Any:
        while "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            if name in self._in_progress:
                return schema
            schema = self.defs[name]
        return schema

    def _exclusive(self, alts: list[Any]) -> bool:
        """Whether no value can match two alternatives (a sufficient, not complete, test)."""
        def disjoint(sets: list[set[str]]) -> bool:
            seen: set[str] = set()
            for s in sets:
                if seen & s:
                    return False
                seen |= s
            return True

        if disjoint([self._value_types(a) for a in alts]):
            return True
        resolved = [self._resolved(a) for a in alts]
        constants = [self._constants(a) for a in resolved]
        if all(c is not None for c in constants) and disjoint(constants):  # type: ignore[arg-type]
            return True
        # A discriminator: a property every alternative requires, with disjoint constants.
        if not all(a.get("type") == "object" and "properties" in a for a in resolved):
            return False
        common = set.intersection(*(set(a["required"]) for a in resolved))
        for prop in sorted(common):
            values = [self._constants(self._resolved(a["properties"][prop])) for a in resolved]
            if all(v is not None for v in values) and disjoint(values):  # type: ignore[arg-type]
                return True
        return False
