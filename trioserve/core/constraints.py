"""Structured outputs: a request's output format and forced tool choice as a GBNF grammar.

Owns turning a request's output constraints into one grammar string (root rule ``root``) that
the worker enforces token by token (worker protocol §6, the ``grammar`` generate field), and
the errors around it. It does not validate the request's shape (its API adapter did), render
prompts, or parse the output (``model.tool_formats`` parses forced calls like any other).
The table below uses Chat Completions' names; every API maps onto the same
:class:`~trioserve.core.request.CoreRequest` fields, and errors use the request's own paths.

Which constraint a request gets:

=============================================  =======================================
request                                        output grammar
=============================================  =======================================
``tool_choice: "required"`` or named function  one call (``parallel_tool_calls: false``)
                                               or several, in the model's call format,
                                               arguments matching the tool's schema
``response_format`` json_object / json_schema  the JSON answer, or — when tools are
                                               declared with ``tool_choice: "auto"`` —
                                               the JSON answer or tool calls
anything else                                  none (unconstrained, as before)
=============================================  =======================================

JSON Schema → GBNF uses the converter maintained with llama.cpp (llama-cpp-python's port,
pinned with it) on a schema first normalized by ``schema_subset``, which rejects what the
converter would enforce wrongly or not at all: a feature that cannot be enforced is a 400
``invalid_value`` naming it, never a silently weaker constraint. Compiled grammars are kept in
a :class:`GrammarCache` keyed by the SHA-256 of the constraint's canonical JSON, bounded in
bytes (``limits.GRAMMAR_CACHE_BYTES``) and filled only by accepted work: the serving core
stores a grammar once the worker took it (its first record came), so requests refused after
compiling (a worker that cannot enforce grammars, a busy server, a worker error) leave nothing.

Everything here is synchronous and pure apart from the cache; compile cost is bounded by
``schema_subset``'s size caps and :data:`MAX_GRAMMAR_BYTES`.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from trioserve import errors, limits
from trioserve.core.request import CoreRequest, ForcedTool, JsonObjectOutput, JsonSchemaOutput, OutputFormat
from trioserve.model.schema_subset import Normalizer, SchemaUnsupported
from trioserve.model.tool_formats import parser_class
from trioserve.model.tool_formats.grammar import CallRules, PropertyRules, UnsupportedInFormat, literal, text_without

__all__ = [
    "Constraint",
    "GrammarCache",
    "constraint_for",
    "require_worker_support",
    "worker_error",
    "compile_grammar",
    "reasoning_state",
    "with_reasoning",
    "unique_keys_field",
    "MAX_GRAMMAR_BYTES",
]

MAX_GRAMMAR_BYTES = 1 << 20  # far below the worker's line limit; a bigger one is a 400


@dataclass(frozen=True)
class Constraint:
    """A compiled output constraint.

    Attributes:
        grammar: GBNF with root rule ``root``, sent as the generate record's ``grammar``.
        param: the request parameter errors about it point at (``response_format`` or
            ``tool_choice``).
        what: a short description for messages (``"response_format json_schema 'person'"``).
        json_keys: every output the grammar admits is JSON (a tool-call wrapper aside) whose
            objects the worker can keep free of repeated keys (``unique_keys``, spec §5.6);
            False for raw-text call syntaxes (``qwen_xml``, ``gemma4``).
        key: the SHA-256 of the constraint's canonical JSON (its :class:`GrammarCache` key).
    """

    grammar: str
    param: str
    what: str
    json_keys: bool = False
    key: bytes = b""


# A cache entry's bookkeeping beyond its strings (the OrderedDict node, the tuple): counted so
# that many tiny grammars cannot exceed the bound either.
_ENTRY_OVERHEAD = 160


class GrammarCache:
    """Compiled grammars (``(grammar, description)``) by constraint key, least recently used
    first out, bounded in bytes: every entry's strings as Python holds them
    (``sys.getsizeof``) plus :data:`_ENTRY_OVERHEAD`. An entry larger than the bound alone
    is not kept. The key is a digest, so a schema's size (a 3.6 MB ``description``) costs
    nothing here; only the grammar it compiles to does, at most :data:`MAX_GRAMMAR_BYTES`.

    Filled only by work the worker accepted (:meth:`put` after a generation's first record,
    ``ServingCore.start``); :func:`constraint_for` only reads it. One per server, shared by
    its models (``http/services.py``), served as ``trioserve_grammar_cache_bytes``.
    Synchronous; safe from any task of the run (no await between read and write).
    """

    def __init__(self, max_bytes: int = limits.GRAMMAR_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[bytes, tuple[str, str, int]] = collections.OrderedDict()
        self._bytes = 0  # Invariant: the sum of the entries' sizes, ≤ max_bytes.

    @property
    def nbytes(self) -> int:
        """What the entries hold now (what ``max_bytes`` bounds)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[str, str] | None:
        """The cached ``(grammar, description)`` for ``key`` (marked recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0], entry[1]

    def put(self, constraint: Constraint) -> None:
        """Keep ``constraint``'s compiled grammar, then drop the least recently used entries
        until the bound holds again."""
        if not constraint.key or constraint.key in self._entries:
            if constraint.key:
                self._entries.move_to_end(constraint.key)
            return
        size = (sys.getsizeof(constraint.key) + sys.getsizeof(constraint.grammar)
                + sys.getsizeof(constraint.what) + _ENTRY_OVERHEAD)
        if size > self.max_bytes:
            return
        self._entries[constraint.key] = (constraint.grammar, constraint.what, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


# --- the converter -----------------------------------------------------------------------


@functools.cache
def _converter() -> ModuleType:
    """llama-cpp-python's ``llama_grammar.py`` (its port of llama.cpp's JSON-Schema-to-GBNF
    converter), executed on its own under a private module name.

    Why not ``import llama_cpp.llama_grammar``: importing any submodule first runs
    ``llama_cpp/__init__.py``, which loads libllama through ctypes — the control plane must
    never load the model runtime. The file itself imports only the standard library, so we
    locate the package without executing it (``find_spec`` of a top-level name does not
    import it) and execute just that file.

    Three corrections are applied to this private copy, each matching what upstream llama.cpp's
    C++ converter (the one the worker's llama.cpp ships) does. The first two fix invalid JSON
    from valid schemas: literals (property names, const/enum values) escape backslashes, so a
    value's JSON escapes survive into the output; a string character excludes the control
    characters JSON forbids unescaped. The third, ``TrioserveConverter``, writes const/enum
    values with their non-ASCII characters as UTF-8 (as a model writes them) rather than as
    ``\\uXXXX`` escapes.
    """
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama-cpp-python is not installed (it provides the grammar converter)")
    path = Path(list(spec.submodule_search_locations)[0]) / "llama_grammar.py"
    file_spec = importlib.util.spec_from_file_location("trioserve._llama_grammar", path)
    if file_spec is None or file_spec.loader is None:
        raise RuntimeError(f"cannot load the grammar converter from {path}")
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    for name in ("SchemaConverter", "PRIMITIVE_RULES", "BuiltinRule", "GRAMMAR_LITERAL_ESCAPES"):
        if not hasattr(module, name):
            raise RuntimeError(f"{path} has no {name}: not the converter version trioserve pins")
    patched: Any = module  # the converter script: the attributes set here are ours
    patched.GRAMMAR_LITERAL_ESCAPE_RE = re.compile(r'[\r\n"\\]')
    patched.GRAMMAR_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
    module.PRIMITIVE_RULES["char"] = module.BuiltinRule(
        r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])',
        [])

    class TrioserveConverter(patched.SchemaConverter):  # type: ignore[misc]  # a base from a module loaded at run time
        def _generate_constant_rule(self, value: Any) -> str:
            return str(self._format_literal(json.dumps(value, ensure_ascii=False)))

    patched.TrioserveConverter = TrioserveConverter
    return module


# --- tool-call formats -----------------------------------------------------------------------
#
# Each format owns the grammar of its own call syntax (``ToolCallParser.constrain``, next to its
# parser); this module compiles the JSON-Schema side and hands it over as CallRules.

_ANNOTATIONS = frozenset({"type", "title", "description", "default", "examples", "$comment",
                          "deprecated", "readOnly", "writeOnly"})
_SCALARS = frozenset({"number", "integer", "boolean", "null"})


def _property_kind(schema: Any) -> tuple[str, tuple[str, ...], bool]:
    """``(kind, choices, scalar)`` of a declared property, for :class:`PropertyRules`."""
    if not isinstance(schema, dict):
        return "mixed", (), False
    values = schema.get("enum") if "enum" in schema else (
        [schema["const"]] if "const" in schema else None)
    declared = schema.get("type")
    types = set(declared) if isinstance(declared, list) else {declared} if isinstance(declared, str) else set()
    if values is not None and isinstance(values, list):
        if values and all(isinstance(v, str) for v in values) and types <= {"string"}:
            return "choices", tuple(values), False
        if all(v is None or isinstance(v, (bool, int, float)) for v in values):
            return "json", (), True
        return "mixed", (), False
    if not types or (set(schema) - _ANNOTATIONS - {"properties", "required", "items",
                                                    "additionalProperties", "prefixItems",
                                                    "minItems", "maxItems", "minimum", "maximum",
                                                    "exclusiveMinimum", "exclusiveMaximum",
                                                    "multipleOf", "minLength", "maxLength",
                                                    "pattern", "format"}):
        return "mixed", (), False  # anyOf, $ref, ...: only JSON formats enforce it
    if types == {"string"}:
        plain = not set(schema) - _ANNOTATIONS
        return ("string" if plain else "mixed"), (), False
    if "string" in types:
        return "mixed", (), False
    return "json", (), types <= _SCALARS


def _call_rules(conv: Any, index: int, name: str, raw: Any, normalized: dict[str, Any],
                prefix: str) -> CallRules:
    arguments = conv.visit(normalized, f"args-{index}")
    if "properties" not in normalized:
        return CallRules(name=name, arguments=arguments, open=True, param=prefix)
    raw_props = raw.get("properties", {}) if isinstance(raw, dict) else {}
    props = []
    for key, sub in normalized["properties"].items():
        kind, choices, scalar = _property_kind(raw_props.get(key))
        rule = conv.visit(sub, f"args-{index}-{_rule_safe(key)}")
        props.append(PropertyRules(key=key, json=rule, kind=kind, choices=choices, scalar=scalar))
    return CallRules(name=name, arguments=arguments, properties=tuple(props),
                     required=frozenset(normalized.get("required", [])),
                     open=normalized.get("additionalProperties") not in (False, None) and not props,
                     param=prefix)


def _rule_safe(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9-]+", "-", key) or "p"


# --- request → constraint ---------------------------------------------------------------------


def constraint_for(req: CoreRequest, *, tool_format: str = "hermes",
                   cache: GrammarCache | None = None) -> Constraint | None:
    """The output constraint ``req`` asks for (its ``output_format``, ``tools``,
    ``tool_choice`` and ``parallel_tool_calls``), or None.

    ``tool_format``: the model's tool-call format (a ``tool_formats`` registry name); its
    parser class writes the grammar of its own call syntax. ``cache``: compiled grammars to
    reuse; read only (the caller :meth:`GrammarCache.put` s the constraint once its request
    was accepted).

    Raises APIError 400 ``invalid_value`` / ``unsupported_parameter`` for ``tool_choice:
    "required"`` without tools, a forced tool that is not declared, a call format that
    cannot be constrained, or a schema feature that cannot be enforced. Every error names the
    request's own parameter path (``req.params``: the API's names for the core's fields).
    """
    paths = req.params
    answer = _answer(req.output_format)
    choice = req.tool_choice
    tools = req.tools
    forced: list[int] | None = None  # positions in ``tools``
    if choice == "required":
        if not tools:
            raise errors.invalid_value(f"Invalid value for '{paths.tool_choice}': 'required' "
                                       f"needs '{paths.tools}'.", paths.tool_choice)
        forced = list(range(len(tools)))
    elif isinstance(choice, ForcedTool):
        forced = [i for i, t in enumerate(tools) if t.name == choice.name]
        if not forced:
            raise errors.invalid_value(
                f"Invalid value for '{paths.forced_tool}': {json.dumps(choice.name)} is not one "
                "of the declared tools.", paths.forced_tool)
    if forced is not None:
        call_tools, mode = forced, "calls"
    elif answer is not None and tools and choice == "auto":
        call_tools, mode = list(range(len(tools))), "answer_or_calls"
    elif answer is not None:
        call_tools, mode = [], "answer"
    else:
        return None
    param = paths.output_format if mode == "answer" else paths.tool_choice
    if call_tools:
        try:
            parser_class(tool_format)
        except ValueError:
            # Never silently unconstrained: an unknown format is refused.
            raise errors.unsupported_parameters([(
                param, f"constraining tool calls in the {tool_format} format is not "
                "supported")]) from None
    key = json.dumps({
        "mode": mode, "answer": answer, "format": tool_format,
        "parallel": req.parallel_tool_calls, "param": param,
        "answer_param": paths.output_format, "schema_param": paths.output_schema,
        "tools": [[tools[i].name, tools[i].parameters, paths.tool_parameters_of(tools[i], i)]
                  for i in call_tools],
    }, separators=(",", ":"), ensure_ascii=False)  # key order kept: it orders the output
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    cached = cache.get(digest) if cache is not None else None
    grammar, what = cached if cached is not None else compile_grammar(key)
    json_keys = not call_tools or parser_class(tool_format).constrained_calls_are_json
    return Constraint(grammar=grammar, param=param, what=what, json_keys=json_keys, key=digest)


def _answer(output: OutputFormat | None) -> dict[str, Any] | None:
    """The answer part of the constraint key: ``{"kind": "json_object"}``, ``{"kind":
    "json_schema", "name", "schema"}`` or None for text. ``strict: false`` is still enforced:
    constraining more than asked never breaks a client."""
    if isinstance(output, JsonObjectOutput):
        return {"kind": "json_object"}
    if isinstance(output, JsonSchemaOutput):
        return {"kind": "json_schema", "name": output.name, "schema": output.schema}
    return None


def compile_grammar(key: str) -> tuple[str, str]:
    """Compile a constraint (the canonical JSON built by :func:`constraint_for`) into
    ``(grammar, description)``. Not cached here (:class:`GrammarCache` is, by its caller).
    Raises APIError as :func:`constraint_for` describes."""
    spec = json.loads(key)
    answer, mode, param = spec["answer"], spec["mode"], spec["param"]
    normalizer = Normalizer()
    parts: dict[str, Any] = {}
    what = ""
    if mode != "calls":
        if answer["kind"] == "json_object":
            parts["answer"] = {"type": "object"}
            what = f"{spec['answer_param']} json_object"
        else:
            parts["answer"] = _normalize(normalizer, answer["schema"], spec["schema_param"])
            what = f"{spec['answer_param']} json_schema '{answer['name']}'"
    tool_specs = []
    if mode != "answer":
        for name, parameters, prefix in spec["tools"]:
            raw = parameters
            if parameters is None:  # a function without parameters takes {}
                parameters = {"type": "object", "properties": {}, "additionalProperties": False}
            arguments = _normalize(normalizer, parameters, prefix)
            if arguments.get("type") != "object":
                raise errors.invalid_value(f"Invalid value for '{prefix}': a function's "
                                           "parameters must describe an object.", prefix)
            tool_specs.append((name, raw if raw is not None else parameters, arguments, prefix))
        names = ", ".join(repr(t[0]) for t in spec["tools"])
        what = (what + " or " if what else "") + f"{param} (a call to {names})"

    conv = _converter().TrioserveConverter(prop_order={}, allow_fetch=False, dotall=False,
                                           raw_pattern=False)
    # One document holding every definition, so "#/$defs/def-N" resolves for each part.
    document = {"$defs": normalizer.defs, **parts,
                **{f"args-{i}": t[2] for i, t in enumerate(tool_specs)}}
    conv.resolve_refs(document, "")
    rules = {name: conv.visit(schema, name) for name, schema in parts.items()}
    extra = ""
    if mode != "answer":
        calls = [_call_rules(conv, i, name, raw, normalized, prefix)
                 for i, (name, raw, normalized, prefix) in enumerate(tool_specs)]
        try:
            part = parser_class(spec["format"]).constrain(calls, spec["parallel"])
        except UnsupportedInFormat as exc:
            raise errors.invalid_value(
                f"Invalid value for '{exc.param}': cannot be enforced: {exc.reason}.",
                exc.param) from None
        extra = "".join(f"{name} ::= {body}\n" for name, body in part.rules.items())
        calls_expr = part.expression
    if mode == "calls":
        root = calls_expr
    elif mode == "answer_or_calls":
        root = f'{rules["answer"]} | {calls_expr}'
    else:
        root = rules["answer"]
    grammar = conv.format_grammar() + "\n" + extra + f"root ::= {root}\n"
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise errors.invalid_value(
            f"The {what} compiles to a grammar of {len(grammar.encode())} bytes, over the "
            f"{MAX_GRAMMAR_BYTES} limit; simplify the schema.", param)
    return grammar, what


def _normalize(normalizer: Normalizer, schema: Any, prefix: str) -> Any:
    try:
        return normalizer.add(schema)
    except SchemaUnsupported as exc:
        param = f"{prefix}.{exc.path}" if exc.path and not exc.path.startswith("[") else prefix + exc.path
        raise errors.invalid_value(
            f"Invalid value for '{param}': cannot be enforced: {exc.reason}.", param) from None


# --- reasoning --------------------------------------------------------------------------------


def reasoning_state(markers: tuple[str, str] | None, prompt: str, may_think: bool) -> str:
    """Where a constrained answer starts relative to the model's thinking block (spec §5.6):

    - ``"inside"``: the rendered prompt ends inside an opened block (the template opened it):
      the grammar first admits the rest of the reasoning and its closing marker;
    - ``"optional"``: the template can think (it has a thinking switch) and the prompt did
      not close the block: the grammar admits one reasoning block first, or none;
    - ``"none"``: no markers, a template that does not think, or a prompt that already closed
      the block (thinking switched off): the constraint applies from the first token.

    The output pipeline splits the admitted block into ``reasoning_content`` by the same rule
    (``reasoning.ReasoningSplitter``), so the constrained part is the ``content``.
    """
    if markers is None:
        return "none"
    start, end = markers
    tail = prompt.rstrip()
    if tail.endswith(start):
        return "inside"
    if tail.endswith(end) or not may_think:
        return "none"
    return "optional"


def with_reasoning(grammar: str, markers: tuple[str, str] | None, state: str) -> str:
    """``grammar`` (root rule ``root``) preceded by the reasoning that ``state``
    (:func:`reasoning_state`) admits."""
    if state == "none" or markers is None:
        return grammar
    start, end = markers
    if not end or end[0] in end[1:]:
        return grammar  # no marker the text rule can stop at: nothing is admitted before it
    lines = grammar.rstrip("\n").split("\n")
    assert lines[-1].startswith("root ::= ")
    lines[-1] = "constrained ::= " + lines[-1][len("root ::= "):]
    rest = f'{text_without(end)} {literal(end)} [ \\t\\n]*'
    prefix = rest if state == "inside" else f'({literal(start)} {rest})?'
    lines += [f"reasoning ::= {prefix}", "root ::= reasoning constrained"]
    return "\n".join(lines) + "\n"


def unique_keys_field(markers: tuple[str, str] | None, state: str) -> dict[str, str]:
    """The generate record's ``unique_keys`` (worker protocol §4) for a JSON constraint after
    the reasoning that ``state`` (:func:`reasoning_state`) admits: where the JSON starts, so
    the worker's key tracking skips the thinking block exactly as :func:`with_reasoning`'s
    grammar admits it."""
    if state == "none" or markers is None:
        return {}
    start, end = markers
    if not end or end[0] in end[1:]:
        return {}  # with_reasoning admits no block here either
    return {"reasoning_end": end} if state == "inside" else {"reasoning_start": start,
                                                            "reasoning_end": end}


# --- worker support and worker errors ----------------------------------------------------------


def require_worker_support(constraint: Constraint | None, grammar_supported: bool) -> None:
    """Refuse a constraint the model worker cannot enforce (its ready record does not report
    ``capabilities.grammar: true``): 400 ``unsupported_parameter``, never unconstrained output."""
    if constraint is not None and not grammar_supported:
        raise errors.APIError(
            400, errors.INVALID_REQUEST,
            f"Unsupported parameter: '{constraint.param}' ({constraint.what}) needs constrained "
            "decoding, which this model worker cannot enforce.",
            code="unsupported_parameter", param=constraint.param)


def worker_error(code: str, message: str, constraint: Constraint | None) -> errors.APIError | None:
    """The 400 for a worker error record about the grammar (it arrives before any token, so
    it is always a plain JSON error); None for other codes."""
    param = constraint.param if constraint is not None else "response_format"
    if code == "invalid_grammar":
        return errors.invalid_value(
            f"Invalid value for '{param}': the model worker rejected its grammar: {message}", param)
    if code == "unsupported_grammar":
        return errors.APIError(
            400, errors.INVALID_REQUEST,
            f"Unsupported parameter: '{param}' needs constrained decoding, which this model "
            f"worker cannot enforce ({message}).", code="unsupported_parameter", param=param)
    return None
