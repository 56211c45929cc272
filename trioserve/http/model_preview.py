"""What a served model's file says before any worker loaded it: its context window, its
capabilities, and whether it can start at all (spec/README.md §2 ``GET /v1/models``, §14.5).

Read from a GGUF's header (worker/model_cost.py ``read_gguf_info``: the key/value section
only, mapped, a few milliseconds) and put through the same template and profile rules a ready
worker's model goes through (core/model_setup.py), so a harness that sizes its context from
``/v1/models`` sees the numbers before the first request, and a model without a usable chat
template is refused before a worker is started for it. Cached per model until its files
change (:func:`model_identity`).

Only llama models with a file are previewed: the fake engine has no file and an ExecuTorch
program no GGUF header; for them only a configured template is checked (a preview with the
problem when it does not load), and otherwise (and for a file whose header cannot be read) the
preview is None: ``/v1/models`` shows what the loaded model reports, as before.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from trioserve.config import Settings
from trioserve.core.model_setup import choose_template
from trioserve.errors import FatalStartupError
from trioserve.model.profiles import resolve_profile
from trioserve.worker.model_cost import read_gguf_info

__all__ = ["ModelPreview", "PreviewCache", "model_identity", "preview_model"]

log = logging.getLogger("trioserve.models")


@dataclass(frozen=True)
class ModelPreview:
    """A model as its file describes it. ``context_length``: the configured ``max_context``,
    else the training context (the worker may cap it by memory: the loaded model's per-slot
    window replaces it); ``capabilities``: as ``GET /v1/models`` shows a loaded model's, None
    without a usable template; ``problem``: why it cannot start (None: it may)."""

    context_length: int | None
    capabilities: dict[str, Any] | None
    problem: str | None


def _file_identity(path: str) -> tuple[str, int, int] | tuple[str, None, None]:
    try:
        st = os.stat(path)
    except OSError:
        return (path, None, None)
    return (path, st.st_size, st.st_mtime_ns)


def model_identity(settings: Settings) -> tuple[object, ...]:
    """The files a model's load depends on (the model file, a chat template file, a Hugging
    Face directory's tokenizer_config.json), each as (path, size, mtime): equal while nothing
    changed on disk. Never raises."""
    paths = []
    try:
        if settings.engine == "llama":
            paths.append(str(settings.resolved_model_path()))
        elif settings.model_path:
            paths.append(settings.model_path)
    except Exception:  # an unresolvable path: its load fails and says why
        pass
    if settings.chat_template:
        paths.append(settings.chat_template)
    if settings.hf_tokenizer_dir:
        paths.append(os.path.join(settings.hf_tokenizer_dir, "tokenizer_config.json"))
    return tuple(_file_identity(p) for p in paths)


def preview_model(settings: Settings) -> ModelPreview | None:
    """The :class:`ModelPreview` of a model served with ``settings``; None when there is no
    GGUF header to read (module docstring). Never raises."""
    if settings.engine != "llama":
        return _configured_template_check(settings)
    try:
        info = read_gguf_info(settings.resolved_model_path())
    except Exception as exc:  # not a GGUF, unreadable: the load itself will say
        log.debug("no header preview of %s: %s", settings.model_path, exc)
        return None
    context = settings.max_context or info.context_length
    try:
        template = choose_template(settings, model_template=info.chat_template, bos="", eos="",
                                   architecture=info.architecture)
        profile = resolve_profile(template, architecture=info.architecture,
                                  override=settings.profile,
                                  tools_injection=settings.tools_injection)
    except FatalStartupError as exc:
        return ModelPreview(context, None, str(exc))
    except Exception as exc:  # a template the probe cannot handle: the worker's set-up decides
        log.debug("no capabilities preview of %s: %s", settings.model_path, exc)
        return ModelPreview(context, None, None)
    return ModelPreview(context, profile.capabilities(), None)


def _configured_template_check(settings: Settings) -> ModelPreview | None:
    """A model without a GGUF header: only the configured template (``--chat-template``,
    ``--hf-tokenizer-dir``) can be checked before its worker reports its own; a preview with
    the problem when it does not load, else None."""
    if not (settings.chat_template or settings.hf_tokenizer_dir):
        return None
    try:  # the model's own template is unknown here: a stand-in, never used when one is set
        choose_template(settings, model_template="{{ '' }}", bos="", eos="", architecture=None)
    except FatalStartupError as exc:
        return ModelPreview(None, None, str(exc))
    return None


class PreviewCache:
    """Each model's :class:`ModelPreview`, read again when its :func:`model_identity`
    changed. Synchronous: a header read is a few milliseconds."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple[object, ...], ModelPreview | None]] = {}

    def get(self, model_id: str, settings: Settings) -> ModelPreview | None:
        identity = model_identity(settings)
        cached = self._entries.get(model_id)
        if cached is not None and cached[0] == identity:
            return cached[1]
        preview = preview_model(settings)
        self._entries[model_id] = (identity, preview)
        return preview
