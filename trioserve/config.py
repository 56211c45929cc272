"""Settings: every knob is a ``TRIOSERVE_*`` environment variable and a ``trioserve serve`` flag.

One declaration per setting (a field of :class:`Settings`, written with :func:`_opt`) gives its
name, type, default, help and bounds; the environment reader (pydantic-settings), the CLI and
the README's configuration section all derive from it. Bounds come from ``limits.py``
(spec/README.md §15): a value outside them is a startup error naming the variable or flag,
never a server that starts and misbehaves.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from trioserve import hub, limits, strict_json
from trioserve.machine import embedded_model_path, physical_memory_bytes, usable_cpus

ENV_PREFIX = "TRIOSERVE_"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


@dataclass(frozen=True)
class _Parse:
    """How a setting's text (an environment value or a flag) becomes its value; kept in the
    field's pydantic metadata by :func:`_opt`."""

    parse: Callable[[str], Any]
    choices: tuple[str, ...] | None
    repeatable: bool = False  # the flag may be repeated; its values are joined with newlines
    also: tuple[str, ...] = ()  # other spellings of the flag (what peers' users type)


SPIN_INHERIT = "inherit"


def _spin_count(text: str) -> str:
    """A GOMP_SPINCOUNT value we pass on: a non-negative integer, or 'inherit'."""
    value = text.strip().lower()
    if value == SPIN_INHERIT or strict_json.ascii_digits(value, max_digits=12) is not None:
        return value
    raise ValueError(f"not a spin count (a non-negative integer or {SPIN_INHERIT!r}): {text!r}")


STREAM_INTERVAL_AUTO = "auto"
# What `auto` means where the model threads fill every CPU (Settings.stream_interval()).
AUTO_STREAM_INTERVAL_MS = 50.0


def _stream_interval(text: str) -> str:
    """A token coalescing interval: 'auto', or milliseconds in [0, 1000]."""
    value = text.strip().lower()
    if value == STREAM_INTERVAL_AUTO:
        return value
    try:
        ms = float(value)
    except ValueError:
        ms = float("nan")
    if not 0 <= ms <= 1000:  # also refuses nan
        raise ValueError(f"not {STREAM_INTERVAL_AUTO!r} or milliseconds in [0, 1000]: {text!r}")
    return f"{ms:g}"


def _opt(default: Any, help: str, *, type: Any = str, choices: tuple[str, ...] | None = None,
         repeatable: bool = False, also: tuple[str, ...] = (), **bounds: float) -> Any:
    """Declare a setting: ``name: <annotation> = _opt(default, help, ...)``.

    Args:
        default: the value when neither the variable nor the flag is given.
        help: one line for ``--help`` and the README.
        type: parses the setting's text (``int``, ``float``, ``str`` or :func:`_bool`); used
            for the flag and the environment variable alike.
        choices: the allowed values, when they are a fixed set.
        repeatable: the flag may be given several times (a text setting: the values are
            joined with newlines).
        also: other spellings of the flag (``--model`` for ``--model-path``, as llama-server
            and vLLM users type it).
        bounds: ``ge``, ``gt``, ``le``, ``lt`` limits (from ``limits.py``), checked at startup.

    Returns:
        The pydantic Field for the class body.
    """
    info = Field(default, description=help, **bounds)
    info.metadata.append(_Parse(type, tuple(choices) if choices else None, repeatable, also))
    return info


def _spec(info: FieldInfo) -> _Parse:
    return next((m for m in info.metadata if isinstance(m, _Parse)), _Parse(str, None))


_NUMBER_KINDS = {int: "an integer", float: "a number"}


def env_name(field: str) -> str:
    """The environment variable of a setting (``queue_depth`` → ``TRIOSERVE_QUEUE_DEPTH``)."""
    return ENV_PREFIX + field.upper()


def flag_name(field: str) -> str:
    """The ``trioserve serve`` flag of a setting (``queue_depth`` → ``--queue-depth``)."""
    return "--" + field.replace("_", "-")


class SettingsError(ValueError):
    """A setting has a malformed or out-of-bounds value; the message names the variable or
    flag and says what is allowed."""


class Settings(BaseSettings):
    """The server's settings. ``Settings()`` reads ``TRIOSERVE_*`` variables (pydantic-settings;
    keyword arguments win over them); :meth:`from_env` is the same with errors that name the
    variable; the CLI layers flags on top with :meth:`with_overrides`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", allow_inf_nan=False)

    engine: str = _opt("llama", "model engine: 'llama' (GGUF through llama.cpp), 'executorch' "
                       "(an ExecuTorch .pte program; needs --model-path and --tokenizer-path, "
                       "see docs/executorch.md) or 'fake' (deterministic scripted worker for "
                       "tests)", choices=("llama", "executorch", "fake"))
    model_path: str = _opt("", "model file: a GGUF for llama (default: the embedded "
                           "SmolLM2-135M-Instruct), a .pte for executorch (required), or "
                           "hf:OWNER/REPO[:QUANT or :FILE.gguf], a GGUF on the Hugging Face Hub "
                           "pulled into its cache at start ('trioserve pull', docs/install.md). Repeat "
                           "the flag (or separate with commas or newlines in the variable) to "
                           "serve several models, each with its file name as id "
                           "(docs/models.md)", repeatable=True, also=("--model",))
    models_dir: str = _opt("", "serve every model in this folder: each *.gguf (id: the file "
                           "name without .gguf) and each subfolder holding a split GGUF or an "
                           "ExecuTorch .pte with its tokenizer.json (id: the folder name); see docs/models.md")
    models_config: str = _opt("", "TOML file describing the served models ([[models]]: id, "
                              "path, engine, aliases, context, slots, workers, ...) and "
                              "[aliases]; see docs/models.md")
    model_alias: str = _opt("", "PATTERN=ID: requested model names matching the fnmatch "
                            "PATTERN are served by model ID (e.g. 'claude-*haiku*=smollm2', "
                            "'*=gemma'); repeat the flag (or separate with commas in the "
                            "variable); tried in order after the exact ids", repeatable=True)
    tokenizer_path: str = _opt("", "executorch: the program's Hugging Face tokenizer.json "
                               "(required; a tokenizer_config.json beside it supplies the chat "
                               "template and EOS)")
    model_id: str = _opt("", "model id clients must send (default: derived from the model); "
                         "with several models, the id of the one --model-path model")
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on (0: any free port)", type=int,
                     ge=limits.PORT_MIN, le=limits.PORT_MAX)
    worker_bin: str = _opt("", "worker executable (default: the one installed with trioserve)")
    worker_args: str = _opt("", "extra worker arguments, shell-quoted (e.g. fault injection)")
    hf_tokenizer_dir: str = _opt("", "Hugging Face model directory whose tokenizer_config.json "
                                 "supplies the chat template (default: the GGUF's template)")
    chatml_fallback: bool = _opt(False, "use a ChatML template when the model has none "
                                 "(otherwise that is a startup error)", type=_bool)
    client_model_names: bool = _opt(True, "serve the model names agent clients send by default "
                                    "(claude-* on /v1/messages) with the loaded model, when one "
                                    "model is served and no --model-alias is set; off: only "
                                    "the model id is accepted", type=_bool)
    no_think: bool = _opt(False, "render templates with enable_thinking=false unless a "
                          "request's chat_template_kwargs says otherwise", type=_bool)
    max_context: int = _opt(0, "context window in tokens (prompt + completion) of every slot (0: "
                            "the model's training context, lowered to fit a quarter of physical "
                            "memory, a hybrid's KV cells counted in its attention layers only; the "
                            "worker logs its choice and GET /v1/models reports it)", type=int, ge=0)
    threads: int = _opt(0, "CPU threads for the model, per worker (0: the CPUs this process "
                        "may use, after its affinity mask and cgroup CPU quota, shared out "
                        "evenly between the --workers)", type=int, ge=0)
    workers: int = _opt(1, "model workers under this server, each its own process with its "
                        "own slots, supervised on its own; sessions are routed to a worker by "
                        "key, anonymous requests by shared prefix, else least loaded. With "
                        "--gpu-layers each worker gets one GPU (CUDA_VISIBLE_DEVICES; see "
                        "docs/worker-pool.md)", type=int, ge=1, le=limits.WORKERS_MAX)
    slots: int = _opt(0, "generations the worker runs at once, batched in one step (0: the "
                      "worker's default, 4; more for GPUs, see docs/cuda.md)", type=int, ge=0)
    spill_budget_bytes: int = _opt(1 << 30, "host memory in bytes for the saved states of named sessions evicted "
                                   "from their slot (0: evicted sessions are dropped)", type=int, ge=0)
    state_dir: str = _opt("", "persistent state store: the directory keeping saved session and prefix states across "
                          "restarts, crashes and replicas sharing it (empty: off; see docs/deployment.md)")
    state_dir_bytes: int = _opt(8 << 30, "the state store's bound in bytes (least recently used dropped)", type=int, ge=0)
    session_branches: int = _opt(4, "branches (sub-agents) one session key keeps, LRU", type=int, ge=1, le=64)
    swa_cache: str = _opt("auto", "sliding-window models (Gemma 2/3, gpt-oss, ...): 'full' keeps "
                          "the window layers' KV cache full-size (every earlier position "
                          "reachable, at a full-attention layer's memory); 'checkpoints' keeps "
                          "only the last window and saves checkpoints at turn boundaries to go "
                          "back further; 'auto' keeps it full-size when that fits the KV budget "
                          "(spec/worker-protocol.md §6.3)", choices=("auto", "full", "checkpoints"))
    swa_checkpoints: int = _opt(4, "state checkpoints per slot at each prompt's end (the small window "
                                "cache's window; a hybrid or recurrent model's recurrent state): a prompt "
                                "diverging where the state cannot be cut back resumes from one (0: none, "
                                "it is prefilled from the start)", type=int, ge=0)
    deterministic: bool = _opt(False, "llama engine: outputs that do not depend on what else "
                               "runs (other streams, shared or resumed prefixes): prompts are "
                               "prefilled in 64-token pieces on a fixed grid, each slot computed on "
                               "its own, and only whole pieces reused; a request's tokens then "
                               "equal a cold run's on the same CPU kernels. Costs throughput with "
                               "several streams (spec/worker-protocol.md §4.5, docs/benchmarks.md)",
                               type=_bool)
    speculative: str = _opt("off", "exact self-speculative decoding (llama engine): 'auto' "
                            "drafts tokens from the request's own prompt and output and from a "
                            "bounded index of recent outputs, verifies them in the shared step "
                            "(same output as without), and drafts only where the steps it ran "
                            "at that batch shape and context depth were measured to pay; 'off' "
                            "never drafts. The worker's ready record says what it does "
                            "(spec/worker-protocol.md §4.6); the fake and ExecuTorch engines "
                            "report 'off'. A start-up check turns it off (a warning says why) "
                            "where a verify step is not bit-identical to plain decoding (on CPU "
                            "that depends on the model, the thread count and the KV cache type: "
                            "spec/worker-protocol.md §4.6 lists the cases measured). Default "
                            "off: on a 2-core CPU with the 135M model it no longer loses but "
                            "shows no clear gain either (docs/benchmarks.md)",
                            choices=("auto", "off"))
    kv_cache_type: str = _opt("f16", "llama: element type of the KV cache (K and V): 'q8_0' "
                              "takes 17/32 of f16's memory, 'q4_0' 9/32, so more context or slots "
                              "fit; outputs may differ slightly from f16. A quantized cache needs "
                              "flash attention (turned on for it; --flash-attn off is a startup "
                              "error). The fake engine scales its reported KV bytes alike; the "
                              "executorch engine refuses anything but f16 (spec/worker-protocol.md §10)",
                              choices=("f16", "q8_0", "q4_0"))
    flash_attn: str = _opt("auto", "llama: flash attention: 'auto' is off on a CPU for a model of 512 MiB or "
                           "more whose every layer attends fully, up to a 1 GiB attention matrix; else on, or "
                           "llama.cpp's choice with --gpu-layers (docs/configuration.md)", choices=("auto", "on", "off"))
    gpu_layers: int = _opt(0, "layers to offload to the GPU (needs a CUDA build of llama.cpp)",
                           type=int)
    fake_script: str = _opt("", "fake engine: JSON file with an array of strings, one per "
                            "generation, cycling")
    queue_depth: int = _opt(16, "requests that may wait for the worker; beyond, 503", type=int,
                            ge=limits.QUEUE_DEPTH_MIN)
    max_body_bytes: int = _opt(4 * 1024 * 1024, "largest request body accepted, in bytes",
                               type=int, ge=limits.MAX_BODY_BYTES_MIN)
    cancel_grace: float = _opt(2.0, "seconds a cancelled generation may take to stop before "
                               "the worker is killed", type=float, gt=0)
    drain_timeout: float = _opt(10.0, "seconds in-flight requests may run on after SIGTERM",
                                type=float, gt=0)
    restart: bool = _opt(True, "restart a worker that crashed or was killed", type=_bool)
    max_crashes: int = _opt(5, "worker failures within --crash-window that stop restarts",
                            type=int, ge=1)
    crash_window: float = _opt(60.0, "seconds over which worker failures are counted",
                               type=float, gt=0)
    ready_timeout: float = _opt(300.0, "seconds a worker may take to load its model",
                                type=float, gt=0)
    log_level: str = _opt("info", "log level", choices=("debug", "info", "warning", "error"))
    # --- profiles ---
    profile: str = _opt("auto", "model profile (tool-call format, reasoning markers, BOS rule): "
                        "'auto' picks one from the chat template and GGUF architecture",
                        choices=("auto", "gemma4", "gemma3", "llama3", "mistral", "qwen3_xml",
                                 "qwen3", "chatml", "generic"))
    chat_template: str = _opt("", "Jinja chat template file, or a shipped template's name (gemma3, "
                              "llama3, mistral, chatml), that replaces the model's own template")
    tools_injection: bool = _opt(True, "when the chat template does not render tools, add them "
                                 "to the system message as a Hermes-style block (false: such "
                                 "requests are a 400)", type=_bool)

    # --- guard & observability ---
    api_key: str = _opt("", "API key clients must send as 'Authorization: Bearer <key>' (every "
                        "route but /health); empty: none. Prefer the environment variable: a flag "
                        "is visible in the process list")
    allow_no_auth: bool = _opt(False, "allow serving on a non-loopback address without an API "
                               "key (otherwise that is a startup error)", type=_bool)
    allowed_hosts: str = _opt("", "comma-separated Host header names accepted, any port ('*': "
                              "any host); default: localhost, 127.0.0.1 and [::1] when --host is "
                              "a loopback address, else any host")
    max_connections: int = _opt(256, "client connections served at once by 'trioserve serve'; "
                                "further connections wait in the listen backlog", type=int)

    # --- behind a router (docs/deployment.md) ---
    instance_id: str = _opt("", "this server's name in the x-trioserve-instance response header, "
                            "so session affinity can be checked from outside (default: "
                            "<hostname>:<port>)")
    metrics_vllm_names: bool = _opt(False, "also expose the router-facing metrics under vLLM's "
                                    "names (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, "
                                    "...), for an endpoint picker left on its default mapping",
                                    type=_bool)
    sse_keepalive: float = _opt(15.0, "seconds a started event stream may stay silent before "
                                "an SSE comment line keeps proxies and clients from timing it "
                                "out (0: never)", type=float, ge=0)

    # --- runtime ---
    stall_timeout: float = _opt(30.0, "seconds a worker with generations in flight may show no "
                                "progress (no record; a step's heartbeats with its work "
                                "counter standing still) before it is pinged", type=float)
    health_timeout: float = _opt(30.0, "seconds a worker may take without progress to answer a "
                                 "ping (or to take a piece of a request line) before it is "
                                 "killed", type=float)
    stream_interval_ms: str = _opt(STREAM_INTERVAL_AUTO,
                                   "the worker writes token records together at most every this "
                                   "many ms (a generation's first at once), so the server wakes "
                                   "once for several tokens: where the model threads fill every "
                                   "core, each wake-up preempts one of them (50 gained 7-10 percent "
                                   "at 2 threads on 2 cores). Clients then get a few tokens per SSE "
                                   "event. 'auto': 50 for a llama.cpp worker on the CPU whose "
                                   "threads fill the usable CPUs, else 0; 0: one event per token "
                                   "(docs/benchmarks.md, spec/worker-protocol.md §4.1)",
                                   type=_stream_interval)
    max_step_ms: float = _opt(5000.0, "llama: while a step carrying prompt tokens takes longer "
                              "than this (ms; e.g. other processes on the worker's cores), the "
                              "worker halves the prompt tokens per step, down to 64, as long as "
                              "that shortens the step, and grows them back when steps are fast "
                              "(0: fixed pieces, boundaries that never depend on timing)",
                              type=float, ge=0)

    # --- several models: load on demand within a memory budget (docs/models.md) ---
    memory_budget_bytes: int = _opt(0, "memory the served models may take together, in bytes: "
                                    "each model's weights (its file) and KV cache, as its workers "
                                    "report them. A load that would exceed it first unloads idle "
                                    "models (no request in flight, not pinned), least recently "
                                    "used first; a model that cannot fit alone is refused with "
                                    "507 model_too_large (0: three quarters of physical memory)",
                                    type=int, ge=0)
    model_idle_unload_s: float = _opt(0.0, "unload a model that is not pinned once no request "
                                      "used it for this many seconds (0: never)", type=float, ge=0)
    model_load_timeout: float = _opt(300.0, "seconds a model's load may take (waiting for memory, "
                                     "then its workers' start) and a request may wait for it; "
                                     "then 503 model_loading, model_load_failed or "
                                     "model_memory_busy", type=float, gt=0)

    # --- cpu ---
    cpu_extra_buffers: str = _opt(
        "auto", "llama.cpp's CPU extra buffer types (weight repacking, AMX): 'auto' verifies them "
        "in a short-lived probe process at start and loads without them if it fails or crashes; "
        "'on' uses them unverified; 'off' never (the worker always runs a warm-up before it is "
        "ready)", choices=("auto", "on", "off"))
    spin_count: str = _opt(
        "1000", "how long an idle model thread busy-waits before it sleeps, in OpenMP spins "
        "(GOMP_SPINCOUNT for the worker; libgomp's own default is 300000, which collapses the "
        "worker when other processes want its cores); 'inherit': leave the worker's OpenMP "
        "environment as the server's", type=_spin_count)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Keyword arguments, then TRIOSERVE_* variables; no .env or secrets files are read
        # behind the operator's back.
        return init_settings, env_settings

    @field_validator("*", mode="before")
    @classmethod
    def _parse_text(cls, value: Any, info: ValidationInfo) -> Any:
        """Text (an environment value, a flag) goes through the setting's ``type`` parser, so
        ``TRIOSERVE_RESTART=off`` and ``--restart off`` mean the same."""
        spec = _spec(cls.model_fields[info.field_name])
        if not isinstance(value, str) or spec.parse is str:
            return value
        try:
            return spec.parse(value)
        except ValueError:
            if spec.parse in _NUMBER_KINDS:  # int()'s own message talks about "base 10"
                raise ValueError(f"not {_NUMBER_KINDS[spec.parse]}: {value!r}") from None
            raise

    @field_validator("*")
    @classmethod
    def _check_choices(cls, value: Any, info: ValidationInfo) -> Any:
        choices = _spec(cls.model_fields[info.field_name]).choices
        if choices and value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    @field_validator("max_context")
    @classmethod
    def _check_max_context(cls, value: int) -> int:
        if 0 < value < limits.MAX_CONTEXT_MIN:
            raise ValueError(f"must be 0 (the model's training context) or >= {limits.MAX_CONTEXT_MIN}, "
                             f"got {value}")
        return value

    def check_engine(self) -> None:
        """Cross-setting checks of the engine, made once every source (variables, then flags)
        is applied: the ExecuTorch engine has no embedded model, so its files are required.

        Raises:
            SettingsError: naming the flags to fix.
        """
        if self.deterministic and self.engine != "llama":
            raise SettingsError("--deterministic applies to the llama engine (the fake engine's outputs "
                                "never depend on the batch; the executorch engine runs one "
                                "generation at a time)")
        if self.kv_cache_type != "f16" and self.flash_attn == "off":
            raise SettingsError(f"--kv-cache-type {self.kv_cache_type} quantizes the V cache, which "
                                "llama.cpp computes only with flash attention, and --flash-attn is "
                                "off: use --flash-attn auto (or on), or --kv-cache-type f16")
        if self.kv_cache_type != "f16" and self.engine == "executorch":
            raise SettingsError(f"--kv-cache-type {self.kv_cache_type}: the executorch engine's KV "
                                "cache is the program's own (f16 only); use --kv-cache-type f16")
        if self.engine != "executorch":
            return
        if not self.model_path or not self.tokenizer_path:
            raise SettingsError("--engine executorch needs --model-path <model.pte> and "
                                "--tokenizer-path <tokenizer.json>")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings from ``TRIOSERVE_<NAME>`` variables (names match case-insensitively):
        ``os.environ`` through pydantic-settings, or only the given mapping (tests, child
        processes).

        Raises:
            SettingsError: a malformed or out-of-bounds value; the message names the variable.
        """
        try:
            if environ is None:
                return cls()
            # Names match case-insensitively, as pydantic-settings matches os.environ.
            given = {key.upper(): value for key, value in environ.items()}
            values = {name: given[env_name(name)] for name in cls.model_fields
                      if env_name(name) in given}
            return cls.model_validate(values)
        except ValidationError as exc:
            raise _settings_error(exc, env_name) from None

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per setting, with its variable and default in the help."""
        for name, info in cls.model_fields.items():
            spec = _spec(info)
            extra: dict[str, Any] = {}
            if spec.parse is _bool:  # `--no-think` alone means true; `--restart false` also works
                extra = dict(nargs="?", const=True, metavar="BOOL")
            elif not spec.choices:
                extra = dict(metavar=name.upper())
            if spec.repeatable:
                extra["action"] = "append"
            parser.add_argument(
                flag_name(name), *spec.also, dest=name, default=None, type=spec.parse, choices=spec.choices,
                **extra, help=f"{info.description} [env {env_name(name)}; default "
                              f"{info.default!r}{_bounds_text(info)}]")

    def with_overrides(self, namespace: argparse.Namespace) -> Settings:
        """These settings with the flags given in ``namespace`` (from :meth:`add_arguments`).

        Raises:
            SettingsError: a flag's value is out of bounds; the message names the flag.
        """
        overrides = {name: getattr(namespace, name) for name in type(self).model_fields
                     if getattr(namespace, name, None) is not None}
        overrides = {name: "\n".join(value) if isinstance(value, list) else value
                     for name, value in overrides.items()}
        try:
            # model_validate, not the constructor: the environment was read already.
            return type(self).model_validate(self.model_dump() | overrides)
        except ValidationError as exc:
            def source(name: str) -> str:
                return flag_name(name) if name in overrides else env_name(name)

            raise _settings_error(exc, source) from None

    def to_env(self) -> dict[str, str]:
        """The settings as ``TRIOSERVE_*`` variables (for a child server process)."""
        out = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            out[env_name(name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out

    # -- derived values ------------------------------------------------------------

    def resolved_model_path(self) -> str:
        """The model file. An ``hf:`` reference that ``trioserve serve`` has not already pulled
        (the hypercorn entry point, tests) is looked up in the Hugging Face cache only: nothing
        is downloaded from inside the server.

        Raises:
            SettingsError: an ``hf:`` reference that is not in the cache.
        """
        if hub.is_model_ref(self.model_path):
            try:
                return str(hub.resolve_model_ref(self.model_path, offline=True))
            except hub.HubError as exc:
                raise SettingsError(f"{env_name('model_path')}: {exc}") from None
        return self.model_path or str(embedded_model_path())

    def resolved_model_id(self) -> str:
        if self.model_id:
            return self.model_id
        if self.engine == "fake":
            return "fake"
        if not self.model_path:
            return EMBEDDED_MODEL_ID
        if hub.is_model_ref(self.model_path):
            return Path(self.resolved_model_path()).stem
        return Path(self.model_path).stem

    def resolved_memory_budget(self) -> int:
        """The models' memory budget in bytes: ``memory_budget_bytes``, else three quarters of
        physical memory (the rest is the system's, the control plane's and the page cache's:
        a budget is what keeps a second model from ending in the kernel's out-of-memory killer)."""
        return self.memory_budget_bytes or physical_memory_bytes() * 3 // 4

    def worker_threads(self) -> int:
        """Model threads of each worker: ``threads``, else an even share of the usable CPUs
        (at least one)."""
        if self.threads > 0:
            return self.threads
        return max(1, usable_cpus() // self.workers)

    def stream_interval(self) -> float:
        """The worker's token coalescing interval in ms (``--stream-interval-ms``). ``auto``:
        50 where a llama.cpp worker computes on the CPU with threads that fill the usable
        CPUs (the server's own wake-ups then preempt a model thread), else 0."""
        if self.stream_interval_ms != STREAM_INTERVAL_AUTO:
            return float(self.stream_interval_ms)
        fills_cpus = self.worker_threads() * self.workers >= usable_cpus()
        return AUTO_STREAM_INTERVAL_MS if self.engine == "llama" and self.gpu_layers == 0 and fills_cpus else 0.0

    def heartbeat_ms(self) -> int:
        """How often a worker inside a long step reports its progress (spec §4.4), in ms:
        four times per ``stall_timeout`` and per ``cancel_grace`` (so a slow step is never
        taken for a stalled one, nor a cancel waiting for the step's end for an ignored one),
        at most once a second, at least every 50 ms."""
        return max(50, min(1000, int(min(self.stall_timeout, self.cancel_grace) * 1000 / 4)))

def _settings_error(exc: ValidationError, source: Callable[[str], str]) -> SettingsError:
    """One line for the first problem: ``TRIOSERVE_QUEUE_DEPTH: must be ≥ 0, got -1``;
    ``source`` names where a field's value came from."""
    error = exc.errors(include_url=False)[0]
    where = source(str(error["loc"][0])) if error["loc"] else "settings"
    ctx = error.get("ctx") or {}
    bounds = {"greater_than_equal": ("ge", "≥"), "greater_than": ("gt", ">"),
              "less_than_equal": ("le", "≤"), "less_than": ("lt", "<")}
    if error["type"] in bounds:
        key, symbol = bounds[error["type"]]
        reason = f"must be {symbol} {_number(ctx[key])}, got {_number(error['input'])}"
    elif error["type"] == "value_error":  # a parser's or a validator's ValueError
        reason = str(ctx.get("error", error["msg"]))
    elif error["type"] == "extra_forbidden":
        reason = "is not a setting"
    elif error["type"] == "finite_number":
        reason = f"must be a finite number, got {error['input']}"
    else:
        reason = f"{error['msg']} (got {error['input']!r})"
    return SettingsError(f"{where}: {reason}")


SETTINGS_TABLE_START = "<!-- settings table: generated from trioserve/config.py by settings_table() -->"
SETTINGS_TABLE_END = "<!-- end of settings table -->"


def settings_table() -> str:
    """Every setting as a Markdown table (variable, flag, default, allowed values, meaning),
    in declaration order: docs/configuration.md holds it between ``SETTINGS_TABLE_START`` and
    ``SETTINGS_TABLE_END`` and a test keeps the two equal."""
    rows = ["| variable | flag | default | allowed | meaning |", "|---|---|---|---|---|"]
    for name, info in Settings.model_fields.items():
        spec = _spec(info)
        if spec.choices:
            allowed = ", ".join(f"`{c}`" for c in spec.choices)
        elif spec.parse is _bool:
            allowed = "on/off"
        else:
            allowed = _bounds_text(info).removeprefix("; ")
        default = info.default
        shown = ("off" if default is False else "on" if default is True
                 else "—" if default == "" else f"`{_number(default)}`")
        meaning = (info.description or "").replace("|", "\\|")
        flags = " ".join(f"`{flag}`" for flag in (flag_name(name), *spec.also))
        rows.append(f"| `{env_name(name)}` | {flags} | {shown} | {allowed} | {meaning} |")
    return "\n".join(rows)


SETTINGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def write_settings_table(doc: Path = SETTINGS_DOC) -> None:
    """Replace the generated table in ``doc`` (between the two markers) with :func:`settings_table`."""
    text = doc.read_text(encoding="utf-8")
    head, _, rest = text.partition(SETTINGS_TABLE_START)
    _, _, tail = rest.partition(SETTINGS_TABLE_END)
    doc.write_text(f"{head}{SETTINGS_TABLE_START}\n{settings_table()}\n{SETTINGS_TABLE_END}{tail}",
                   encoding="utf-8")


def _bounds_text(info: FieldInfo) -> str:
    """``"; ≥ 0"``-style text for a setting's bounds, for ``--help``."""
    symbols = {annotated_types.Ge: ("ge", "≥"), annotated_types.Gt: ("gt", ">"),
               annotated_types.Le: ("le", "≤"), annotated_types.Lt: ("lt", "<")}
    parts = [f"{symbols[type(m)][1]} {_number(getattr(m, symbols[type(m)][0]))}"
             for m in info.metadata if type(m) in symbols]
    return "; " + ", ".join(parts) if parts else ""


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
