"""A scripted stand-in for SessionRuntime for tests of the serving core and its adapters:
no worker, no processes, no clock. Each submitted generation hands out its scripted text
pieces, then ends with a ``done`` record decoded by the real codec."""

from __future__ import annotations

import json
from typing import Any

from trioserve.model.chat_template import ChatTemplate
from trioserve.config import Settings
from trioserve.core.serving import ServingCore
from trioserve.model.profiles import resolve_profile
from trioserve.worker.runtime import GenerationError
from trioserve.worker.protocol import Done, GenerateParams, decode_record


class ScriptedGeneration:
    def __init__(self, params: GenerateParams, pieces: list[str], done: dict[str, Any],
                 fail_after: GenerationError | None = None) -> None:
        self.params = params
        self.done: Done | None = None
        self._pieces = list(pieces)
        self._done = done
        self._fail_after = fail_after
        self.cancel_requested = False
        self.worker = 0  # the pool index (the runtime's Generation has it)
        self.received = 0
        self.text_parts: list[str] = []  # every piece handed out (the runtime's Generation has it)

    async def receive(self) -> str | None:
        if self.cancel_requested and self.done is None:
            self._finish(cancelled=True)
            return None
        if self._pieces:
            self.received += 1
            self.text_parts.append(self._pieces[0])
            return self._pieces.pop(0)
        if self._fail_after is not None:
            raise self._fail_after
        if self.done is None:
            self._finish()
        return None

    def _finish(self, cancelled: bool = False) -> None:
        record = dict(self._done)
        if cancelled:
            record.update(cancelled=True, finish_reason="stop")
            record.pop("generated_token_ids", None)
        decoded = decode_record(json.dumps(record).encode())
        assert isinstance(decoded, Done)
        self.done = decoded

    def cancel(self) -> None:
        self.cancel_requested = True


class ScriptedRuntime:
    """``script``: one entry per generation, in order: a list of text pieces, optionally with
    the done record's overrides (``(pieces, {"finish_reason": "length", ...})``)."""

    def __init__(self, *script: list[str] | tuple[list[str], dict[str, Any]]) -> None:
        self.script = list(script)
        self.generations: list[ScriptedGeneration] = []

    def submit(self, params: GenerateParams, arrival: Any = None) -> ScriptedGeneration:
        if arrival is not None:
            arrival.done()
        entry = self.script.pop(0)
        pieces, extra = (entry, {}) if isinstance(entry, list) else entry
        completion = sum(len(p.encode()) for p in pieces)
        done = {"type": "done", "id": len(self.generations) + 1, "finish_reason": "stop",
                "cancelled": False, "stop_string": None, "prompt_tokens": len(params.prompt),
                "completion_tokens": completion, "reused_prompt_tokens": 0, **extra}
        fail = extra.pop("fail_after", None) if isinstance(extra, dict) else None
        done.pop("fail_after", None)
        gen = ScriptedGeneration(params, pieces, done, fail)
        self.generations.append(gen)
        return gen


def scripted_core(*script: Any, template: ChatTemplate | None = None,
                  grammar: bool = False) -> tuple[ServingCore, ScriptedRuntime]:
    """A configured ServingCore (ChatML, the Hermes tool format) over a ScriptedRuntime."""
    runtime = ScriptedRuntime(*script)
    core = ServingCore(settings=Settings(engine="fake"), model_id="fake",
                       runtime=runtime)  # type: ignore[arg-type]
    core.template = template or ChatTemplate.chatml()
    core.profile = resolve_profile(core.template, architecture=None, override="auto",
                                   tools_injection=True, bos_token="")
    core.grammar_supported = grammar
    return core, runtime
