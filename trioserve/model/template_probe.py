"""What a chat template does with the variables and message shapes it is given, found out by
rendering probe conversations through it (:func:`probe_template`); the model profile
(model/profiles.py) is resolved from the answer.

Each question is answered by rendering with and without the feature: a template that raises
on the feature, or renders the same text either way, does not support it.

Pure logic: no I/O, no processes, no HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trioserve.model.chat_template import ChatTemplate
from trioserve.model.template_errors import TemplateError

__all__ = ["TemplateSupport", "probe_template"]

# --- template probing --------------------------------------------------------------------

# Names unlikely to occur in any template, so finding them in a render proves the template
# rendered that part of the probe.
_PROBE_TOOL_NAME = "trioserve_probe_tool"
_PROBE_CALL_NAME = "trioserve_probe_call"
_PROBE_RESULT = "trioserve probe result"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_TOOL_NAME, "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}
_PROBE_USER = [{"role": "user", "content": "trioserve probe"}]


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template does with the variables and message shapes it is given.

    Attributes:
        renders_tools: ``tools`` appear in the prompt.
        thinking_switch: ``enable_thinking`` changes the prompt.
        thinks_by_default: with a thinking switch, the template (with the operator's
            defaults) renders as with ``enable_thinking`` true when the request says nothing.
        reads_reasoning_effort: ``reasoning_effort`` changes the prompt.
        renders_tool_calls: an assistant message's ``tool_calls`` appear in the prompt.
        renders_tool_results: a ``tool`` message renders (without raising) and its content
            appears in the prompt.
        variables: every variable name the template's source refers to (Jinja's static
            analysis); None when unknown, which makes no request kwarg a 400.
        probe_prompt: the template's render of a one-message conversation with the
            generation prompt (None if it failed): whether it opens a thinking block itself.
        refuses_user_runs: the template raises on two consecutive user messages but renders
            one (roles must alternate): :meth:`ServingProfile.prepare_messages` joins them.
        refuses_system_runs: it raises on two leading system messages but renders one.
        refuses_later_system: it raises on a system message after the first turn but
            renders the same conversation without it.
    """

    renders_tools: bool
    thinking_switch: bool
    reads_reasoning_effort: bool
    renders_tool_calls: bool
    renders_tool_results: bool
    variables: frozenset[str] | None = field(default=None, compare=False)
    probe_prompt: str | None = field(default=None, compare=False)
    refuses_user_runs: bool = False
    refuses_system_runs: bool = False
    refuses_later_system: bool = False
    thinks_by_default: bool = True


def _try_render(template: ChatTemplate, messages: list[dict[str, Any]], **kwargs: Any) -> str | None:
    try:
        return template.render(messages, **kwargs)
    except TemplateError:
        return None


def probe_template(template: ChatTemplate) -> TemplateSupport:
    """Render probe conversations through ``template`` and compare.

    Each question is answered by rendering with and without the feature: a template that
    raises on the feature, or renders the same text either way, does not support it. The
    operator's defaults (``no_think``) are overridden by explicit variables, so they do not
    change the answer.
    """
    def render(messages: list[dict[str, Any]], **kwargs: Any) -> str | None:
        return _try_render(template, messages, **kwargs)

    with_tools = render(_PROBE_USER, tools=[_PROBE_TOOL])
    renders_tools = with_tools is not None and _PROBE_TOOL_NAME in with_tools

    on = render(_PROBE_USER, template_kwargs={"enable_thinking": True})
    off = render(_PROBE_USER, template_kwargs={"enable_thinking": False})
    thinking_switch = on is not None and off is not None and on != off

    # Compared against each other, not against "absent": a template may default differently.
    efforts = {render(_PROBE_USER, template_kwargs={"reasoning_effort": e}) for e in ("low", "high")}
    reads_effort = None not in efforts and len(efforts) > 1

    call = {"id": "call_probe", "type": "function",
            "function": {"name": _PROBE_CALL_NAME, "arguments": {"x": "y"}}}
    history: list[dict[str, Any]] = _PROBE_USER + [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_probe", "content": _PROBE_RESULT}]
    rendered = render(history, tools=[_PROBE_TOOL] if renders_tools else None)
    if rendered is None:  # the tool message may be what failed: ask about calls alone
        calls_only = render(history[:2], tools=[_PROBE_TOOL] if renders_tools else None,
                            add_generation_prompt=False)
        renders_calls = calls_only is not None and _PROBE_CALL_NAME in calls_only
        renders_results = False
    else:
        renders_calls = _PROBE_CALL_NAME in rendered
        renders_results = _PROBE_RESULT in rendered
    # Role runs: each shape is asked with and without the extra same-role message, so a
    # template that fails for another reason (e.g. it needs a system message) is not taken
    # for one that needs alternation.
    def refuses(longer: list[dict[str, Any]], shorter: list[dict[str, Any]]) -> bool:
        return render(shorter) is not None and render(longer) is None

    default = render(_PROBE_USER)  # the operator's defaults in force, no request variables
    user, system = _PROBE_USER[0], {"role": "system", "content": "trioserve probe system"}
    answer = {"role": "assistant", "content": "trioserve probe answer"}
    return TemplateSupport(renders_tools=renders_tools, thinking_switch=thinking_switch,
                           reads_reasoning_effort=reads_effort, renders_tool_calls=renders_calls,
                           renders_tool_results=renders_results, variables=template.variables,
                           probe_prompt=default, thinks_by_default=not thinking_switch or default == on,
                           refuses_user_runs=refuses([user, user], [user]),
                           refuses_system_runs=refuses([system, system, user], [system, user]),
                           refuses_later_system=refuses([user, answer, system, user],
                                                        [user, answer, user]))
