"""A model's set-up: which chat template and which model profile serve it.

:func:`set_up` runs when a worker of the model becomes ready (``ServingCore.configure``);
:func:`choose_template` and :func:`missing_template` are the same rules for callers that know
the model only from its file's header (``GET /v1/models`` before a load, the check before a
load that could not start: http/on_demand_host.py).

Template order: the ``chat_template`` setting (a Jinja file, or the name of a template
trioserve ships: model/family_templates.py) when set, else a Hugging Face directory when
configured, else the template the model carries, else ChatML only when the operator allowed
the fallback. No template is a :class:`~trioserve.errors.FatalStartupError`: serving a model
with a guessed format would silently produce garbage. Its message names the shipped template
of the model's family where there is one.

Pure logic over the settings and what the worker (or the header) reports; reading a template
file is the only I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from trioserve.config import Settings
from trioserve.errors import FatalStartupError
from trioserve.model.chat_template import ChatTemplate
from trioserve.model.family_templates import FAMILY_TEMPLATES, family_template, suggested_template
from trioserve.model.profiles import ServingProfile, detect_profile, resolve_profile
from trioserve.model.segments import ControlTokens
from trioserve.model.template_errors import TemplateLoadError
from trioserve.model.tool_formats import parser_class
from trioserve.worker.protocol import Ready

__all__ = ["ModelSetup", "choose_template", "missing_template", "set_up"]

log = logging.getLogger("trioserve.serving")


@dataclass(frozen=True)
class ModelSetup:
    """The chat template and the profile in force for one model."""

    template: ChatTemplate
    profile: ServingProfile


def missing_template(settings: Settings, *, has_model_template: bool,
                     architecture: str | None) -> str | None:
    """Why no chat template would serve a model with these settings (the message of the
    FatalStartupError :func:`choose_template` raises), or None when one would."""
    s = settings
    if s.chat_template or s.hf_tokenizer_dir or has_model_template or s.chatml_fallback:
        return None
    family, how = detect_profile("", architecture)
    shipped = suggested_template(family.name) if how == "architecture" else None
    hint = (f"--chat-template {shipped} (the template trioserve ships for its {architecture} "
            "architecture), or " if shipped else "")
    return (f"the model has no chat template: pass {hint}--chat-template with a Jinja file or "
            f"the name of a shipped template ({', '.join(FAMILY_TEMPLATES)}), --hf-tokenizer-dir "
            "with a directory holding tokenizer_config.json, or --chatml-fallback to use ChatML")


def choose_template(settings: Settings, *, model_template: str | None, bos: str, eos: str,
                    architecture: str | None) -> ChatTemplate:
    """The chat template in force (module docstring: the order). ``model_template``: the
    template the model file carries (None: none); ``bos``/``eos``: its tokens' text.

    Raises:
        FatalStartupError: no template, or one that does not load (it will not load after a
            restart either).
    """
    s = settings
    try:
        if s.chat_template:
            source = _chat_template_source(s.chat_template)
            if s.hf_tokenizer_dir:  # its tokens are the more specific
                hf = ChatTemplate.from_hf_dir(s.hf_tokenizer_dir)
                bos, eos = hf.bos_token, hf.eos_token
            return ChatTemplate.from_string(source, bos, eos, no_think=s.no_think)
        if s.hf_tokenizer_dir:
            return ChatTemplate.from_hf_dir(s.hf_tokenizer_dir, no_think=s.no_think)
        if model_template:
            return ChatTemplate.from_string(model_template, bos_token=bos, eos_token=eos,
                                            no_think=s.no_think)
        if s.chatml_fallback:
            return ChatTemplate.chatml(no_think=s.no_think)
    except (TemplateLoadError, OSError, UnicodeDecodeError) as exc:
        raise FatalStartupError(f"cannot load the chat template: {exc}") from exc
    reason = missing_template(s, has_model_template=False, architecture=architecture)
    raise FatalStartupError(reason or "the model has no chat template")


def _chat_template_source(value: str) -> str:
    """The ``chat_template`` setting's template: the file it names, else the shipped template
    of that name when no such file exists."""
    path = Path(value)
    if not path.exists():
        shipped = family_template(value)
        if shipped is not None:
            return shipped
    return path.read_text(encoding="utf-8")


def set_up(settings: Settings, ready: Ready) -> ModelSetup:
    """The template and profile for the model a ready worker serves (module docstring). The
    profile comes from the ``profile`` setting or the template and the GGUF architecture; the
    template is probed for what it renders, and the result is logged (and served as
    ``capabilities`` by ``GET /v1/models``). BOS/EOS come from the Hugging Face directory
    when given, else from the ready record.

    Raises:
        FatalStartupError: no usable template, an unknown profile or tool-call format.
    """
    s = settings
    special = ready.special_tokens
    template = choose_template(s, model_template=ready.chat_template or None,
                               bos=special.get("bos") or "", eos=special.get("eos") or "",
                               architecture=ready.architecture)
    try:
        profile = resolve_profile(template, architecture=ready.architecture,
                                  override=s.profile, tools_injection=s.tools_injection,
                                  bos_token=special.get("bos") or template.bos_token)
    except KeyError as exc:  # an unknown profile name (the CLI's choices prevent it)
        raise FatalStartupError(str(exc.args[0])) from exc
    try:
        parser_class(profile.tool_format)  # every registry entry names a known parser
    except ValueError as exc:
        raise FatalStartupError(str(exc)) from exc
    log.info("%s", profile.describe())
    control = special.get("control")
    if isinstance(control, list) and all(isinstance(t, str) for t in control):
        # The worker's tokenizer decides what a control token is, whatever the template
        # source: render_segments refuses request text that would become one.
        template.control_tokens = ControlTokens(control)
    return ModelSetup(template, profile)
