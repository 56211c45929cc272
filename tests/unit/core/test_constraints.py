"""Structured outputs: schema → grammar conversion, unsupported-feature detection, tool-call
grammars, request errors, caching and the grammar on the wire.

Grammars are checked with llama.cpp's own grammar engine over the embedded model's vocabulary
(``testkit/grammar_check.py``): each supported feature must accept a valid instance and refuse an
invalid one, exactly as the llama worker's sampler will.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

import jsonschema
import pytest

from trioserve.core import constraints as structured
from trioserve.core.request import CoreRequest, ParamPaths
from trioserve.errors import APIError
from trioserve.worker.protocol import Generate, GenerateParams, request_fields
from trioserve.model.json_patterns import MAX_REPEAT, rewrite_pattern
from trioserve.model.schema_subset import ALTERNATIVES_BUDGET, MAX_ENUM_VALUES, MAX_INT_RANGE

from testkit.core_requests import constrained_request
from testkit.grammar_check import GrammarChecker

PREFIX = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def checker():
    c = GrammarChecker()
    yield c
    c.close()


request = constrained_request


def schema_format(schema: Any, name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def grammar_for(schema: Any) -> str:
    constraint = structured.constraint_for(request(schema_format(schema)))
    assert constraint is not None and constraint.param == "response_format"
    return constraint.grammar


def api_error(req: CoreRequest) -> APIError:
    with pytest.raises(APIError) as info:
        structured.constraint_for(req)
    return info.value


# --- the converter is loaded without the model runtime --------------------------------------


def test_converter_loads_without_importing_llama_cpp():
    code = ("import sys; from trioserve.core import constraints as structured; structured._converter(); "
            "from trioserve.core.request import CoreRequest, JsonObjectOutput; "
            "structured.constraint_for(CoreRequest((), output_format=JsonObjectOutput())); "
            "maps = open('/proc/self/maps').read(); "
            "print('llama_cpp' in sys.modules, 'libllama' in maps, 'libggml' in maps)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    assert out == ["False", "False", "False"]


# --- supported features: (schema, valid instances, invalid instances) ------------------------

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
       "required": ["a"], "additionalProperties": False}
TREE = {"$defs": {"node": {"type": "object", "properties": {
            "v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}

SUPPORTED: list[tuple[str, Any, list[Any], list[str]]] = [
    ("object-required-optional", OBJ, [{"a": 1}, {"a": -7, "b": "x"}],
     ['{"b": "x"}', '{"a": 1, "c": 2}', '{"a": "1"}', '[]']),
    ("nested-objects", {"type": "object", "properties": {"p": OBJ}, "required": ["p"],
                        "additionalProperties": False},
     [{"p": {"a": 2}}], ['{"p": {}}', '{"p": {"a": 1.5}}']),
    ("additional-properties-absent-narrows", {"type": "object", "properties": {"a": {"type": "null"}}},
     [{}, {"a": None}], ['{"z": 1}']),
    ("additional-properties-schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     [{}, {"x": 1, "y": 2}], ['{"x": "1"}']),
    ("declared-properties-get-no-extra-keys", {  # an extra key could repeat a declared one
        "type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     [{"a": 1}, {}], ['{"a": 1, "a": "x"}', '{"a": 1, "b": 2}']),
    ("any-object", {"type": "object"}, [{}, {"k": [1, {"n": None}], "s": "é"}], ['[1]', '"s"']),
    ("enum", {"type": "string", "enum": ["red", "green", 3]}, ["red", "green"],
     ['"blue"', "3"]),
    ("const", {"const": {"k": [1, "two"]}}, [{"k": [1, "two"]}], ['{"k": [1]}']),
    ("array-bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
     [[1], [1, 2, 3]], ["[]", "[1, 2, 3, 4]", '["1"]']),
    ("tuple", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "boolean"}]},
     [["x", True]], ['["x"]', '[true, "x"]']),
    ("any-of", {"anyOf": [{"type": "string"}, {"type": "null"}]}, ["s", None], ["1"]),
    ("type-list-with-keywords", {"type": ["string", "null"], "maxLength": 2}, ["ab", None],
     ['"abc"', "1"]),
    ("one-of-distinct-types", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, [1, "1"],
     ["true"]),
    ("one-of-discriminator", {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
         "required": ["kind", "x"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "b"}, "x": {"type": "integer"}},
         "required": ["kind", "x"], "additionalProperties": False}]},
     [{"kind": "a", "x": 1}, {"kind": "b", "x": 2}], ['{"kind": "c", "x": 1}']),
    ("ref-recursive", TREE, [{"v": 1, "kids": [{"v": 2, "kids": []}]}], ['{"v": 1}']),
    ("ref-name-like-a-property", {  # the converter would reuse the property's rule named "addr"
        "type": "object", "properties": {"addr": {"type": "string"}, "home": {"$ref": "#/$defs/addr"}},
        "required": ["addr", "home"], "additionalProperties": False,
        "$defs": {"addr": {"type": "object", "properties": {"zip": {"type": "integer"}},
                           "required": ["zip"], "additionalProperties": False}}},
     [{"addr": "x", "home": {"zip": 1}}], ['{"addr": "x", "home": "y"}']),
    ("all-of-single", {"allOf": [{"type": "boolean"}], "description": "d"}, [True, False], ["1"]),
    ("string-length", {"type": "string", "minLength": 2, "maxLength": 3}, ["ab", "abc", "a\nb"],
     ['"a"', '"abcd"']),
    ("pattern-anchored", {"type": "string", "pattern": r"^[A-Z]{2}-\d{3}$"}, ["AB-123"],
     ['"AB-12"', '"ab-123"', '"AB-1234"']),
    ("pattern-unanchored-searches", {"type": "string", "pattern": "[0-9]"}, ["abc1def", "7"],
     ['"abc"']),
    ("pattern-escapes-and-groups", {"type": "string", "pattern": r"^(?:\w+\.)+\w{2,4}$"},
     ["a.bc", "x.y.com"], ['"abc"', '"a.b"']),
    ("pattern-top-level-alternation", {"type": "string", "pattern": "^cat|dog$"}, ["cat", "dog"],
     ['"cow"']),
    ("pattern-literal-quote-and-backslash", {"type": "string", "pattern": r'^a"\\b$'},
     ['a"\\b'], ['"a\\"b"']),
    ("pattern-dot-never-breaks-json", {"type": "string", "pattern": "^.{3}$"}, ["abc"],
     ['"a"b"', '"ab\\\\"']),
    ("pattern-negated-class", {"type": "string", "pattern": "^[^0-9]+$"}, ["ab"], ['"a1"']),
    ("format-date", {"type": "string", "format": "date"}, ["2024-02-29"], ['"2024-13-01"', '"24-01-01"']),
    ("format-date-time", {"type": "string", "format": "date-time"}, ["2024-01-31T23:59:59Z"],
     ['"2024-01-31 23:59:59"']),
    ("format-time", {"type": "string", "format": "time"}, ["10:20:30+02:00"], ['"10:20"']),
    ("format-uuid", {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"],
     ['"123e4567"']),
    ("integer-range", {"type": "integer", "minimum": -2, "maximum": 10}, [-2, 0, 10],
     ["11", "-3", "1.5"]),
    ("integer-exclusive-range", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3},
     [1, 2], ["0", "3"]),
    ("integer-multiple-of", {"type": "integer", "minimum": 0, "maximum": 20, "multipleOf": 5},
     [0, 15], ["3"]),
    ("number", {"type": "number"}, [3.14, -2, 1e5], ['"1"', "01"]),
    ("boolean-null", {"type": ["boolean", "null"]}, [True, None], ['"true"']),
    ("empty-schema-any-value", {}, [1, "s", [None], {"a": {}}], []),
    ("special-characters-in-literals", {
        "type": "object", "properties": {'q"uote': {"enum": ["a\\b", 'c"d', "é\n\t"]}},
        "required": ['q"uote'], "additionalProperties": False},
     [{'q"uote': "a\\b"}, {'q"uote': 'c"d'}, {'q"uote': "é\n\t"}], ['{"q\\"uote": "ab"}']),
    ("strings-hold-no-raw-control-characters", {"type": "string"}, ["a\nb"], ['"a\nb"']),
    ("annotations-ignored", {"type": "integer", "title": "t", "description": "d", "default": 1,
                             "examples": [1], "$comment": "c", "x-vendor": True}, [5], ['"5"']),
]


@pytest.mark.parametrize("schema, valid, invalid", [c[1:] for c in SUPPORTED],
                         ids=[c[0] for c in SUPPORTED])
def test_supported_feature_is_enforced(checker, schema, valid, invalid):
    grammar = grammar_for(schema)
    assert checker.parses(grammar), grammar
    for instance in valid:
        jsonschema.validate(instance, schema)  # the case itself is right
        text = json.dumps(instance, ensure_ascii=False)  # as a model writes it: UTF-8
        assert checker.matches(grammar, text), f"refused {text!r}\n{grammar}"
    for text in invalid:
        assert checker.matches(grammar, text) is False, f"accepted {text!r}\n{grammar}"


def test_json_object_allows_any_object_only(checker):
    constraint = structured.constraint_for(request({"type": "json_object"}))
    assert constraint is not None and constraint.param == "response_format"
    for text in ('{}', '{"a": [1, {"b": null}], "c": "d"}'):
        assert checker.matches(constraint.grammar, text)
    for text in ('[]', '"x"', '{"a": 1', 'x{}'):
        assert not checker.matches(constraint.grammar, text)


# --- unsupported features: a 400 naming the keyword ----------------------------------------

UNSUPPORTED: list[tuple[str, Any, str]] = [
    ("number-minimum", {"type": "object", "properties": {"x": {"type": "number", "minimum": 0}}},
     "properties.x.minimum"),
    ("integer-one-sided", {"type": "integer", "minimum": 0}, "minimum"),
    ("integer-range-too-large", {"type": "integer", "minimum": 0, "maximum": MAX_INT_RANGE},
     "minimum"),
    ("integer-empty-range", {"type": "integer", "minimum": 5, "maximum": 4}, "minimum"),
    ("multiple-of-without-range", {"type": "integer", "multipleOf": 2}, "multipleOf"),
    ("format-email", {"type": "string", "format": "email"}, "format"),
    ("pattern-and-length", {"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength"),
    ("format-and-length", {"type": "string", "format": "date", "minLength": 3}, "minLength"),
    ("pattern-lookahead", {"type": "string", "pattern": "^(?=a)a$"}, "pattern"),
    ("pattern-word-boundary", {"type": "string", "pattern": r"\bword\b"}, "pattern"),
    ("pattern-backreference", {"type": "string", "pattern": r"^(a)\1$"}, "pattern"),
    ("pattern-inner-anchor", {"type": "string", "pattern": "^a$|^b$"}, "pattern"),
    ("pattern-invalid", {"type": "string", "pattern": "^(a$"}, "pattern"),
    ("pattern-class-of-unsafe-only", {"type": "string", "pattern": '^["\\\\]$'}, "pattern"),
    ("pattern-huge-repeat", {"type": "string", "pattern": f"^a{{{MAX_REPEAT + 1}}}$"}, "pattern"),
    ("not", {"not": {"type": "string"}}, "not"),
    ("if-then", {"if": {"type": "string"}, "then": {"minLength": 1}}, "if"),
    ("pattern-properties", {"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ("min-properties", {"type": "object", "minProperties": 1}, "minProperties"),
    ("unique-items", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     "uniqueItems"),
    ("contains", {"type": "array", "contains": {"type": "integer"}}, "contains"),
    ("max-items-over-cap", {"type": "array", "maxItems": MAX_REPEAT + 1}, "maxItems"),
    ("max-below-min", {"type": "array", "minItems": 3, "maxItems": 2}, "maxItems"),
    ("tuple-outside-bounds", {"type": "array", "prefixItems": [{"type": "null"}], "minItems": 2},
     "prefixItems"),
    ("one-of-overlapping", {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]},
     "oneOf"),
    ("one-of-integer-and-number", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ("all-of-several", {"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf"),
    ("any-of-with-sibling", {"type": "object", "anyOf": [{"type": "object"}]}, "type"),
    ("ref-with-sibling", {"$ref": "#/$defs/a", "maxLength": 2, "$defs": {"a": {"type": "string"}}},
     "maxLength"),
    ("ref-remote", {"$ref": "https://example.com/schema.json"}, "$ref"),
    ("ref-unresolvable", {"$ref": "#/$defs/missing"}, "$ref"),
    ("ref-left-recursion", {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
                            "$ref": "#/$defs/a"}, "$defs.a.anyOf[0].$ref"),
    ("unknown-keyword", {"type": "string", "maxLenght": 3}, "maxLenght"),
    ("nullable", {"type": "string", "nullable": True}, "nullable"),
    ("required-not-declared", {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},
     "required[1]"),
    ("false-subschema", {"type": "object", "properties": {"a": False}}, "properties.a"),
    ("enum-with-other-keyword", {"enum": ["a", "bb"], "maxLength": 1}, "maxLength"),
    ("enum-no-value-of-type", {"type": "integer", "enum": ["a"]}, "enum"),
    ("const-wrong-type", {"type": "string", "const": 1}, "const"),
    ("bad-type", {"type": "strnig"}, "type"),
    ("keywords-of-two-types-untyped", {"maxLength": 2, "maxItems": 2}, ""),
    ("deep-nesting", json.loads('{"type": "array", "items": ' * 70 + "{}" + "}" * 70),
     "items" + ".items" * 64),
    ("repetition-budget", {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": MAX_REPEAT} for i in range(25)}}, "properties.p20.maxLength"),
]


# Grammar cost: the sampler's per-token work grows with the live alternatives.
UNSUPPORTED += [
    ("enum-over-the-limit", {"type": "string", "enum": [f"v{i}" for i in range(20_000)]}, "enum"),
    ("enum-one-over", {"enum": list(range(MAX_ENUM_VALUES + 1))}, "enum"),
    ("alternatives-budget", {"type": "object", "properties": {
        f"p{i}": {"enum": list(range(MAX_ENUM_VALUES))} for i in range(5)}}, "properties.p4.enum"),
    ("anyof-budget", {"anyOf": [{"const": i} for i in range(ALTERNATIVES_BUDGET + 1)]}, "anyOf"),
    ("integer-ranges-budget", {"type": "array", "prefixItems": [
        {"type": "integer", "minimum": 0, "maximum": MAX_INT_RANGE - 1} for _ in range(5)]},
     "prefixItems[4]"),
]


def test_grammar_limits_name_the_limit():
    err = api_error(request(schema_format({"type": "string", "enum": [str(i) for i in range(20_000)]})))
    assert f"limit of {MAX_ENUM_VALUES} values" in err.message and "20000 values" in err.message
    err = api_error(request(schema_format({"anyOf": [{"const": i} for i in range(ALTERNATIVES_BUDGET + 1)]})))
    assert f"more than {ALTERNATIVES_BUDGET}" in err.message


def test_an_enum_at_the_limit_is_enforced(checker):
    values = [f"value {i}" for i in range(MAX_ENUM_VALUES)]
    grammar = grammar_for({"type": "string", "enum": values})
    assert checker.parses(grammar)


@pytest.mark.parametrize("schema, path", [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_feature_is_a_400_naming_it(schema, path):
    err = api_error(request(schema_format(schema)))
    param = f"{PREFIX}.{path}" if path else PREFIX
    assert (err.status, err.code, err.param) == (400, "invalid_value", param), err.message
    assert "cannot be enforced" in err.message and param in err.message


def test_the_largest_bounds_still_parse_in_llama_cpp(checker):
    for schema in ({"type": "string", "maxLength": MAX_REPEAT},
                   {"type": "array", "items": {"type": "integer"}, "maxItems": MAX_REPEAT},
                   {"type": "string", "pattern": f"^(ab|c[0-9]){{0,{MAX_REPEAT}}}$"}):
        assert checker.parses(grammar_for(schema)), schema


def test_pattern_rewrite_is_anchored_and_grouped():
    assert rewrite_pattern("^ab$") == ("^(ab)$", 0)
    rewritten, repeats = rewrite_pattern(r"x\d{2,5}")
    assert rewritten.startswith("^[") and rewritten.endswith("]*$") and repeats == 5


# --- no constraint -----------------------------------------------------------------------------


def test_text_and_no_constraint_give_no_grammar():
    assert structured.constraint_for(request({"type": "text"})) is None
    assert structured.constraint_for(request()) is None
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert structured.constraint_for(request(tools=tools, tool_choice="auto")) is None
    assert structured.constraint_for(request(tools=tools, tool_choice="none")) is None


# --- tool calls -----------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop"}}


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_required_tool_choice_forces_a_valid_call(checker):
    constraint = structured.constraint_for(request(tools=[WEATHER, NOOP], tool_choice="required"))
    assert constraint is not None and constraint.param == "tool_choice"
    g = constraint.grammar
    assert checker.matches(g, call("get_weather", {"city": "Paris"}))
    assert checker.matches(g, call("noop", {}))
    assert checker.matches(g, call("get_weather", {"city": "Oslo", "unit": "c"}) + "\n"
                           + call("noop", {}))  # parallel by default
    for text in ("Sure!", call("get_weather", {}), call("get_weather", {"city": 1}),
                 call("other", {}), call("noop", {"x": 1}),
                 '{"name": "noop", "arguments": {}}'):
        assert not checker.matches(g, text), text


def test_named_tool_choice_allows_only_that_tool_and_one_call(checker):
    req = request(tools=[WEATHER, NOOP], parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    g = structured.constraint_for(req).grammar
    assert checker.matches(g, call("get_weather", {"city": "Rome"}))
    assert not checker.matches(g, call("noop", {}))
    assert not checker.matches(g, call("get_weather", {"city": "a"}) + "\n"
                               + call("get_weather", {"city": "b"}))


def test_response_format_with_auto_tools_allows_answer_or_calls(checker):
    req = request(schema_format({"type": "object", "properties": {"x": {"type": "integer"}},
                                 "required": ["x"], "additionalProperties": False}),
                  tools=[WEATHER], tool_choice="auto")
    constraint = structured.constraint_for(req)
    assert constraint.param == "tool_choice"
    assert checker.matches(constraint.grammar, '{"x": 1}')
    assert checker.matches(constraint.grammar, call("get_weather", {"city": "Paris"}))
    assert not checker.matches(constraint.grammar, "hello")
    none = structured.constraint_for(dataclasses.replace(req, tool_choice="none"))
    assert not checker.matches(none.grammar, call("get_weather", {"city": "Paris"}))


def test_tool_choice_errors():
    err = api_error(request(tool_choice="required"))
    assert (err.code, err.param) == ("invalid_value", "tool_choice")
    err = api_error(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}))
    assert (err.code, err.param) == ("invalid_value", "tool_choice.function.name")
    bad = {"type": "function", "function": {"name": "b", "parameters": {
        "type": "object", "properties": {"n": {"type": "number", "maximum": 3}}}}}
    err = api_error(request(tools=[WEATHER, bad], tool_choice="required"))
    assert (err.code, err.param) == ("invalid_value", "tools[1].function.parameters.properties.n.maximum")
    # a named choice only needs the named tool to be enforceable
    assert structured.constraint_for(request(tools=[WEATHER, bad], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})) is not None
    scalar = {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}
    err = api_error(request(tools=[scalar], tool_choice="required"))
    assert (err.code, err.param) == ("invalid_value", "tools[0].function.parameters")


def test_errors_carry_the_apis_own_parameter_paths():
    """Messages' names: a tool's schema is ``input_schema``, the output format sits in
    ``output_config``; the core builds the path from the request's ``params``."""
    paths = ParamPaths(tool_parameters="tools[{index}].input_schema", forced_tool="tool_choice.name",
                       output_format="output_config.format",
                       output_schema="output_config.format.schema")
    bad = {"type": "function", "function": {"name": "b", "parameters": {
        "type": "object", "properties": {"n": {"type": "number", "maximum": 3}}}}}
    req = dataclasses.replace(request(tools=[WEATHER, bad], tool_choice="required"), params=paths)
    assert api_error(req).param == "tools[1].input_schema.properties.n.maximum"
    req = dataclasses.replace(request(schema_format({"type": "integer", "minimum": 0})), params=paths)
    err = api_error(req)
    assert err.param == "output_config.format.schema.minimum" and err.param in err.message
    req = dataclasses.replace(request(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "x"}}), params=paths)
    assert api_error(req).param == "tool_choice.name"
    constraint = structured.constraint_for(dataclasses.replace(request({"type": "json_object"}),
                                                               params=paths))
    assert constraint.param == "output_config.format"
    assert constraint.what == "output_config.format json_object"


def test_unknown_call_format_is_refused_never_unconstrained():
    with pytest.raises(APIError) as info:
        structured.constraint_for(request(tools=[NOOP], tool_choice="required"), tool_format="nope")
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "tool_choice")


# --- cache, size limit, worker support, wire ------------------------------------------------


def test_grammars_are_cached_by_canonical_json_keeping_property_order():
    cache = structured.GrammarCache()
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    b = {"type": "object", "properties": {"y": {"type": "integer"}, "x": {"type": "integer"}}}
    first = structured.constraint_for(request(schema_format(a)), cache=cache)
    assert first is not None and len(cache) == 0  # read only: the core keeps accepted ones
    cache.put(first)
    again = structured.constraint_for(request(schema_format(json.loads(json.dumps(a)))), cache=cache)
    assert again is not None and again.grammar is first.grammar and again.key == first.key
    other = structured.constraint_for(request(schema_format(b)), cache=cache)
    assert other is not None and other.key != first.key
    assert other.grammar != first.grammar  # the output follows the declared order


def test_oversized_grammar_is_a_400(monkeypatch):
    monkeypatch.setattr(structured, "MAX_GRAMMAR_BYTES", 200)
    err = api_error(request({"type": "json_object"}))
    assert (err.code, err.param) == ("invalid_value", "response_format")


def test_worker_without_grammar_support_refuses():
    constraint = structured.constraint_for(request({"type": "json_object"}))
    structured.require_worker_support(None, False)
    structured.require_worker_support(constraint, True)
    with pytest.raises(APIError) as info:
        structured.require_worker_support(constraint, False)
    err = info.value
    assert (err.status, err.code, err.param) == (400, "unsupported_parameter", "response_format")
    assert "cannot enforce" in err.message


def test_worker_grammar_errors_map_to_400():
    constraint = structured.constraint_for(request(tools=[NOOP], tool_choice="required"))
    err = structured.worker_error("invalid_grammar", "parse error at 1", constraint)
    assert (err.status, err.code, err.param) == (400, "invalid_value", "tool_choice")
    assert "parse error at 1" in err.message
    err = structured.worker_error("unsupported_grammar", "no grammar", constraint)
    assert (err.status, err.code, err.param) == (400, "unsupported_parameter", "tool_choice")
    assert structured.worker_error("engine_error", "x", constraint) is None


def test_grammar_travels_in_the_generate_record():
    grammar = structured.constraint_for(request({"type": "json_object"})).grammar
    wire = request_fields(Generate(GenerateParams(prompt="p", grammar=grammar)))
    assert wire["grammar"] == grammar and wire["op"] == "generate"
    assert "grammar" not in request_fields(Generate(GenerateParams(prompt="p")))


# --- serving: a grammar error before the first token is a plain 400 ---------------------------


class _FailingGeneration:
    """A generation whose first record is a worker error (as the llama worker sends for a
    grammar it cannot parse, before any token)."""

    def __init__(self, params, code: str) -> None:
        self.params, self.code, self.cancelled = params, code, False
        # What the core's stats report reads of a generation (the runtime's has them).
        self.done, self.cancel_requested, self.worker = None, False, 0

    async def receive(self):
        from trioserve.worker.runtime import GenerationError
        raise GenerationError(self.code, "parse: error parsing grammar")

    def cancel(self) -> None:
        self.cancelled = True


class _Runtime:
    def __init__(self, code: str) -> None:
        self.code, self.generations = code, []

    def submit(self, params, arrival=None):
        self.generations.append(_FailingGeneration(params, self.code))
        return self.generations[-1]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code, expected", [("invalid_grammar", "invalid_value"),
                                            ("unsupported_grammar", "unsupported_parameter")])
async def test_grammar_error_record_is_a_400_before_any_byte(stream, code, expected):
    from trioserve.model.chat_template import ChatTemplate
    from trioserve.config import Settings
    from trioserve.model.profiles import resolve_profile
    from trioserve.api.chat.adapter import ServingChat
    from trioserve.core.serving import ServingCore

    runtime = _Runtime(code)
    core = ServingCore(settings=Settings(engine="fake"), model_id="fake", runtime=runtime)
    core.template = ChatTemplate.chatml()
    core.profile = resolve_profile(core.template, architecture=None, override="auto",
                                   tools_injection=True, bos_token="")
    core.grammar_supported = True
    serving = ServingChat(core)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            "response_format": {"type": "json_object"}}
    with pytest.raises(APIError) as info:
        await serving.create(json.dumps(body).encode())  # raises instead of returning a stream
    err = info.value
    assert (err.status, err.code, err.param) == (400, expected, "response_format")
    [gen] = runtime.generations
    assert gen.params.grammar and gen.cancelled
