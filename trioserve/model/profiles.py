"""Model profiles: what serving a model family needs beyond its chat template.

A :class:`ModelProfile` is one registry entry: the tool-call format its output uses (a parser
*name* from ``trioserve.model.tool_formats``), the markers around its reasoning text, extra stop
strings, and the prompt-prefix rule (whether the prompt must start with exactly one BOS).
Adding a model family is one entry in :data:`PROFILES` (plus one parser class when its tool
calls use a new format).

At startup :func:`resolve_profile` picks the profile — the ``profile`` setting when it names
one, else the first profile whose template markers all occur in the chat template's source,
else the first whose GGUF architecture (``general.architecture`` from the worker's ready record)
matches, else ``generic`` — and probes the *actual* template
(:func:`~trioserve.model.template_probe.probe_template`) for what it supports: does it render ``tools``, ``enable_thinking``, ``reasoning_effort``, assistant
``tool_calls`` and ``tool`` messages. The result, a :class:`ServingProfile`, drives the request
path (the chat adapter) and is shown in ``GET /v1/models`` as ``capabilities``.

Tools the model cannot see are never silently dropped: when the template does not render
``tools``, :meth:`ServingProfile.prepare_messages` injects them as a Hermes-style block into the
system message (and, where the template cannot show them either, earlier tool calls and tool
results as Hermes text), or — with injection turned off — the request is refused.

Pure logic: no I/O, no processes, no HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from trioserve.model.chat_template import ChatTemplate
from trioserve.model.template_probe import TemplateSupport, probe_template

__all__ = [
    "ReasoningMarkers",
    "ModelProfile",
    "TemplateSupport",
    "UnreadTemplateVariable",
    "ServingProfile",
    "PROFILES",
    "PROFILE_NAMES",
    "get_profile",
    "detect_profile",
    "probe_template",
    "resolve_profile",
    "tool_block",
    "THINKING_OFF_EFFORTS",
]


@dataclass(frozen=True)
class ReasoningMarkers:
    """The text that opens and closes a model's reasoning block in its output."""

    start: str
    end: str


THINK = ReasoningMarkers("<think>", "</think>")


@dataclass(frozen=True)
class ModelProfile:
    """One model family (a registry entry; see the module docstring).

    Attributes:
        name: the value of the ``profile`` setting that selects it.
        description: which models it is for (shown in logs).
        tool_format: name of the tool-call parser for its output (``hermes``, ``qwen_xml``,
            ``gemma4``, ``llama3_json``, ``mistral``).
        reasoning: markers of its reasoning block, or None for models that never think.
        extra_stops: stop strings added to every request (text the model writes when it
            should have ended its turn, e.g. the opening of a tool response it must not
            invent).
        bos_once: the prompt must start with exactly one BOS token (the worker adds none;
            spec/worker-protocol.md §4): a duplicate the template renders is removed, a
            missing one is added, so ``prompt_tokens`` counts what the model really sees.
        template_markers: auto-detection: all of these occur in the template source ...
        template_excludes: ... and none of these.
        architectures: auto-detection fallback: GGUF ``general.architecture`` values.
    """

    name: str
    description: str
    tool_format: str
    reasoning: ReasoningMarkers | None
    extra_stops: tuple[str, ...] = ()
    bos_once: bool = False
    template_markers: tuple[str, ...] = ()
    template_excludes: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()


# Order matters for auto-detection: the first profile whose template markers match wins, so
# more specific entries come first (Qwen3's template also contains ChatML's markers).
PROFILES: tuple[ModelProfile, ...] = (
    ModelProfile(
        name="gemma4", description="Gemma 4 (<|turn> turns, thought channel, native tool tokens)",
        tool_format="gemma4", reasoning=ReasoningMarkers("<|channel>thought", "<channel|>"),
        extra_stops=("<|tool_response>",), bos_once=True,
        template_markers=("<|turn>",), architectures=("gemma4",)),
    ModelProfile(
        name="gemma3", description="Gemma 2/3 (<start_of_turn> turns, no native tools)",
        # Gemma 3's template does not render tools: they are injected as Hermes text, so the
        # calls come back in Hermes form.
        tool_format="hermes", reasoning=None, extra_stops=("<end_of_turn>",), bos_once=True,
        template_markers=("<start_of_turn>",), architectures=("gemma3", "gemma3n", "gemma2", "gemma")),
    ModelProfile(
        name="llama3", description="Llama 3.x (header-id turns, JSON tool calls)",
        tool_format="llama3_json", reasoning=None, extra_stops=("<|eom_id|>",), bos_once=True,
        template_markers=("<|start_header_id|>",)),
    ModelProfile(
        name="mistral", description="Mistral ([INST] turns, [TOOL_CALLS] JSON, [THINK] reasoning)",
        tool_format="mistral", reasoning=ReasoningMarkers("[THINK]", "[/THINK]"), bos_once=True,
        template_markers=("[INST]",)),
    ModelProfile(
        name="qwen3_xml", description="Qwen3.5 / Qwen3-Coder (ChatML, XML tool calls, <think>)",
        tool_format="qwen_xml", reasoning=THINK,
        template_markers=("<|im_start|>", "<function=", "<parameter=")),
    ModelProfile(
        name="qwen3", description="Qwen3 (ChatML, Hermes tool calls, <think> with a switch)",
        tool_format="hermes", reasoning=THINK,
        template_markers=("<|im_start|>", "<think>"), architectures=("qwen3", "qwen3moe")),
    ModelProfile(
        name="chatml", description="ChatML with Hermes tool calls (SmolLM2, Qwen2.5, ...)",
        # <think> is still split out: harmless for models that never write it.
        tool_format="hermes", reasoning=THINK,
        template_markers=("<|im_start|>",), architectures=("qwen2",)),
    ModelProfile(
        name="generic", description="unknown family: Hermes tool calls, <think> reasoning",
        tool_format="hermes", reasoning=THINK),
)

PROFILE_NAMES: tuple[str, ...] = tuple(p.name for p in PROFILES)
_BY_NAME = {p.name: p for p in PROFILES}

# reasoning_effort values that turn thinking off (spec §11); every other value turns it on.
THINKING_OFF_EFFORTS = frozenset({"none", "minimal"})


def get_profile(name: str) -> ModelProfile:
    """The registry entry called ``name``. Raises KeyError naming the known ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILE_NAMES)}") from None


def detect_profile(template_source: str, architecture: str | None) -> tuple[ModelProfile, str]:
    """Pick a profile from the template's markers, then the architecture.

    Returns ``(profile, how)`` with ``how`` one of ``"template"``, ``"architecture"``,
    ``"default"``. Template markers win over the architecture because architectures are
    shared across families (SmolLM2 is ``llama`` but speaks ChatML).
    """
    for profile in PROFILES:
        if (profile.template_markers
                and all(m in template_source for m in profile.template_markers)
                and not any(m in template_source for m in profile.template_excludes)):
            return profile, "template"
    arch = (architecture or "").lower()
    for profile in PROFILES:
        if arch and arch in profile.architectures:
            return profile, "architecture"
    return _BY_NAME["generic"], "default"


class UnreadTemplateVariable(ValueError):
    """A request sets a template variable the chat template would ignore (400
    ``unsupported_parameter``; :attr:`param` is the request field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# --- tool injection ----------------------------------------------------------------------

_TOOL_BLOCK_HEAD = (
    "# Tools\n\n"
    "You can call functions to help answer. Their JSON signatures are listed between "
    "<tools> and </tools>:\n<tools>\n")
_TOOL_BLOCK_TAIL = (
    "\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments between "
    "<tool_call> and </tool_call>, one block per call:\n"
    '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>')


def tool_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes-style block that tells a model about ``tools`` when its template cannot.

    One tool per line as JSON (non-ASCII kept), then how to call one: the
    ``<tool_call>{"name", "arguments"}</tool_call>`` form the Hermes parser reads back.
    """
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return _TOOL_BLOCK_HEAD + lines + _TOOL_BLOCK_TAIL


def _joined(first: Any, second: Any) -> str:
    """Two turns' texts as one (empty ones add no separator)."""
    return "\n\n".join(t for t in (first or "", second or "") if t)


def _plain(message: Mapping[str, Any]) -> bool:
    """A message that only has a role and text (and maybe a name) can be joined with another."""
    return set(message) <= {"role", "content", "name"}


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # not a JSON object: keep the client's text verbatim
        args_json = arguments
    else:
        args_json = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(function.get("name"), ensure_ascii=False)}, "arguments": {args_json}}}\n</tool_call>'


# --- the resolved profile ----------------------------------------------------------------

ToolsMode = Literal["template", "injected", "rejected"]


@dataclass(frozen=True)
class ServingProfile:
    """The profile in force: registry entry + what the template supports + settings.

    Attributes:
        profile: the registry entry.
        chosen_by: ``"setting"``, ``"template"``, ``"architecture"`` or ``"default"``.
        support: the probed template support.
        tools_mode: ``"template"`` (the template renders tools), ``"injected"`` (trioserve
            adds them to the system message) or ``"rejected"`` (requests with tools are a 400).
        bos_token: the model's BOS text (``""`` when it has none: the BOS rule is then off).
    """

    profile: ModelProfile
    chosen_by: str
    support: TemplateSupport
    tools_mode: ToolsMode
    bos_token: str = ""

    @property
    def name(self) -> str:
        return self.profile.name

    @property
    def tool_format(self) -> str:
        """Parser name for tool calls: Hermes whenever trioserve injected the tools (the
        injected block asks for Hermes calls), else the profile's own format."""
        return "hermes" if self.tools_mode == "injected" else self.profile.tool_format

    @property
    def reasoning_markers(self) -> ReasoningMarkers | None:
        return self.profile.reasoning

    @property
    def honours_reasoning_effort(self) -> bool:
        return self.support.thinking_switch or self.support.reads_reasoning_effort

    def capabilities(self) -> dict[str, Any]:
        """The ``capabilities`` object of ``GET /v1/models`` (spec §2)."""
        markers = self.profile.reasoning
        return {
            "profile": self.name,
            "profile_chosen_by": self.chosen_by,
            "tool_format": self.tool_format,
            "tools": self.tools_mode,
            "thinking_switch": self.support.thinking_switch,
            "reasoning_effort": self.honours_reasoning_effort,
            "reasoning_markers": [markers.start, markers.end] if markers else None,
        }

    def describe(self) -> str:
        """One line for the startup log."""
        c = self.capabilities()
        return (f"model profile {c['profile']} (chosen by {c['profile_chosen_by']}): "
                f"tools {c['tools']}, tool format {c['tool_format']}, "
                f"enable_thinking {'yes' if c['thinking_switch'] else 'no'}, "
                f"reasoning_effort {'yes' if self.support.reads_reasoning_effort else 'no'}, "
                f"reasoning markers {c['reasoning_markers']}")

    # -- request path ------------------------------------------------------------------

    def thinks(self, reasoning_effort: str | None, request_kwargs: Mapping[str, Any]) -> bool:
        """Whether this request's prompt has the model think: its ``enable_thinking`` (from
        ``reasoning_effort`` or ``chat_template_kwargs``, as :meth:`template_kwargs` resolves
        it), else the template's default. True for a template without a thinking switch
        (what it does is then not the request's to say). Call after :meth:`template_kwargs`
        accepted the same arguments."""
        if not self.support.thinking_switch:
            return True
        value = self.template_kwargs(reasoning_effort, request_kwargs).get("enable_thinking")
        return self.support.thinks_by_default if value is None else bool(value)

    def template_kwargs(self, reasoning_effort: str | None,
                        request_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Template variables for a request: ``reasoning_effort`` mapped, then the request's
        own ``chat_template_kwargs`` (which win: they are the more specific instruction).

        Honesty rule (the same for ``reasoning_effort`` and the kwargs): a variable the
        template would ignore is refused rather than silently dropped — ``enable_thinking``
        on a template without a thinking switch (``false`` is accepted when the model has no
        reasoning markers: no thinking is then exactly what happens), ``reasoning_effort`` on
        one that does not read it (an off value likewise), and any other name the template
        never refers to.

        Raises:
            UnreadTemplateVariable: (a ValueError) naming the request field; the caller
                answers 400 ``unsupported_parameter`` with its ``param``.
        """
        out: dict[str, Any] = {}
        if reasoning_effort is not None:
            if not self.honours_reasoning_effort:
                raise UnreadTemplateVariable(
                    "this model's chat template has no thinking switch: it reads neither "
                    "enable_thinking nor reasoning_effort", "reasoning_effort")
            if self.support.thinking_switch:
                out["enable_thinking"] = reasoning_effort not in THINKING_OFF_EFFORTS
            if self.support.reads_reasoning_effort:
                out["reasoning_effort"] = reasoning_effort
        for name, value in request_kwargs.items():
            self._check_kwarg(name, value)
        out.update(request_kwargs)
        return out

    def _check_kwarg(self, name: str, value: Any) -> None:
        # Whether the model thinks without being asked: the template itself opens a thinking
        # block (a profile's markers alone say only how thinking would be written).
        markers, probe = self.profile.reasoning, self.support.probe_prompt
        thinks = markers is not None and (probe is None or markers.start in probe)
        param = f"chat_template_kwargs.{name}"
        if name == "enable_thinking":
            if self.support.thinking_switch or (value is False and not thinks):
                return
            raise UnreadTemplateVariable(
                "this model's chat template has no thinking switch: it does not read "
                "enable_thinking", param)
        if name == "reasoning_effort":
            if self.support.reads_reasoning_effort or (value in THINKING_OFF_EFFORTS and not thinks):
                return
            raise UnreadTemplateVariable(
                "this model's chat template does not read reasoning_effort", param)
        variables = self.support.variables
        if variables is not None and name not in variables:
            raise UnreadTemplateVariable(
                f"this model's chat template does not read a variable named {name!r}", param)

    def prepare_messages(self, messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools to render for a request (``tools``: None when the request
        has none or ``tool_choice`` is ``"none"``).

        With ``tools_mode == "template"`` they pass through unchanged. Otherwise the template
        cannot show tools, so: past assistant ``tool_calls`` it cannot show either are appended
        to that message's content as Hermes ``<tool_call>`` blocks, and ``tool`` messages it
        cannot show become user messages holding ``<tool_response>`` blocks (consecutive ones
        merged) — with or without tools in this request, so the model always sees the whole
        exchange; and with ``"injected"``, the tools become a Hermes block at the end of the
        system message (a system message is added when there is none) and ``None`` is
        returned as ``tools``. The request's own dicts are never modified.

        Raises:
            ValueError: tools were given, the template cannot render them, and injection is
                off (``tools_mode == "rejected"``; the caller answers 400).
        """
        if self.tools_mode == "template":
            return self._merge_role_runs([dict(m) for m in messages]), ([dict(t) for t in tools] if tools else None)
        if tools and self.tools_mode == "rejected":
            raise ValueError(
                "this model's chat template does not render tools and tool injection is off "
                "(setting tools_injection=false)")
        out: list[dict[str, Any]] = []
        merging_results = False  # the last message in `out` is a user turn of tool results
        for message in messages:
            m = dict(message)
            if m.get("role") == "assistant" and m.get("tool_calls") and not self.support.renders_tool_calls:
                calls = "\n".join(_call_text(c) for c in m.pop("tool_calls"))
                m["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
            if m.get("role") == "tool" and not self.support.renders_tool_results:
                block = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
                if merging_results:
                    out[-1]["content"] += "\n" + block
                    continue
                m = {"role": "user", "content": block}
                out.append(m)
                merging_results = True
                continue
            out.append(m)
            merging_results = False
        out = self._merge_role_runs(out)
        if tools:
            block = tool_block(tools)
            if out and out[0].get("role") == "system":
                first = out[0]
                first["content"] = f"{first['content']}\n\n{block}" if first.get("content") else block
            else:
                out.insert(0, {"role": "system", "content": block})
        return out, None

    def _merge_role_runs(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Join same-role runs the template refuses (spec §10.3, "Role runs"), as probed
        (:class:`TemplateSupport`): a leading run of system messages becomes one; a system
        message after that becomes user text; consecutive plain user messages (no tool
        fields) become one. Joined texts are separated by a blank line. A template that
        renders such runs gets the messages unchanged. ``messages`` are the caller's copies
        (may be modified)."""
        s = self.support
        if not (s.refuses_user_runs or s.refuses_system_runs or s.refuses_later_system):
            return messages
        out: list[dict[str, Any]] = []
        for m in messages:
            role = m.get("role")
            leading = all(o.get("role") == "system" for o in out)
            if role == "system" and out and leading and s.refuses_system_runs:
                out[-1]["content"] = _joined(out[-1].get("content"), m.get("content"))
                continue
            if role == "system" and not leading and s.refuses_later_system:
                m = {"role": "user", "content": m.get("content") or ""}
                role = "user"
            if (role == "user" and out and out[-1].get("role") == "user" and s.refuses_user_runs
                    and _plain(m) and _plain(out[-1])):
                out[-1]["content"] = _joined(out[-1].get("content"), m.get("content"))
                continue
            out.append(m)
        return out

    def stops(self, request_stops: Sequence[str]) -> tuple[str, ...]:
        """The request's stop strings plus the profile's extra ones (no duplicates)."""
        out = list(request_stops)
        out += [s for s in self.profile.extra_stops if s not in out]
        return tuple(out)

    def apply_prefix_rule(self, segments: Sequence[tuple[str, bool]]) -> tuple[tuple[str, bool], ...]:
        """Make the prompt start with exactly one BOS when the profile says so.

        Only special (template) text counts: a BOS-looking string in user content is plain
        text and is neither stripped nor counted. Without ``bos_once`` or a BOS text the
        segments are returned unchanged.
        """
        segs = [s for s in segments if s[0]]
        bos = self.bos_token
        if not (self.profile.bos_once and bos):
            return tuple(segs)
        if segs and segs[0][1] and segs[0][0].startswith(bos):
            text = segs[0][0]
            while text.startswith(bos + bos):
                text = text[len(bos):]
            segs[0] = (text, True)
            return tuple(segs)
        return ((bos, True), *segs)


def resolve_profile(template: ChatTemplate, *, architecture: str | None, override: str = "auto",
                    tools_injection: bool = True, bos_token: str | None = None) -> ServingProfile:
    """Choose and probe the profile for a loaded template (see the module docstring).

    Args:
        template: the chat template in force (after any override).
        architecture: GGUF ``general.architecture`` from the ready record, if known.
        override: ``"auto"`` or a profile name (the ``profile`` setting).
        tools_injection: inject tools when the template cannot render them (else refuse).
        bos_token: the model's BOS text; defaults to the template's ``bos_token``.

    Raises:
        KeyError: ``override`` names no profile.
    """
    if override and override != "auto":
        profile, how = get_profile(override), "setting"
    else:
        profile, how = detect_profile(template.source, architecture)
    support = probe_template(template)
    if support.renders_tools:
        mode: ToolsMode = "template"
    else:
        mode = "injected" if tools_injection else "rejected"
    bos = template.bos_token if bos_token is None else bos_token
    return ServingProfile(profile=profile, chosen_by=how, support=support, tools_mode=mode,
                          bos_token=bos or "")
