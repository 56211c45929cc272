"""Compatibility: the Chat Completions adapter moved to :mod:`trioserve.api.chat`, over the
API-neutral serving core (:mod:`trioserve.core`). These names stay importable from here."""

from __future__ import annotations

from .api.chat import ChatStream, ServingChat, new_completion_id
from .core.serving import api_error as _api_error
from .core.serving import splice_ids

__all__ = ["ChatStream", "ServingChat", "new_completion_id", "splice_ids", "_api_error"]
