"""The models one server serves, and which requested ``model`` names each answers
(spec/README.md §2.1).

A :class:`ModelSpec` describes one served model: its id, the names it also answers to, its
engine and files, and its per-model settings (context, slots, workers, KV cache type, ...).
:func:`build_registry` builds the :class:`ModelRegistry` from the server's settings:

- nothing configured: one model from the single-model settings (the embedded SmolLM2 by
  default), with the same id as always;
- ``--models-config FILE``: a TOML file with ``[[models]]`` tables and an ``[aliases]``
  table (docs/models.md);
- ``--models-dir DIR``: every ``*.gguf`` in DIR (id: the file name without ``.gguf``) and
  every subfolder holding a multi-file GGUF or an ExecuTorch ``.pte`` (id: the folder name);
- ``--model-path``, repeatable: one model per path (id: the file name without extension,
  or ``--model-id`` when exactly one path is given).

Names resolve in this order: an exact model id; then the aliases, ``fnmatch`` patterns, in
the order given (``--model-alias`` flags first, then the file's per-model ``aliases`` in
model order, then its ``[aliases]`` table); then, only when one model is served and no alias
is configured, the names agent clients send by default (``claude-*`` on ``/v1/messages``)
unless ``client_model_names`` is off. Anything else is unknown (404 ``model_not_found``).

Every problem (duplicate ids, missing files, bad TOML, an alias naming no model) is a
:class:`RegistryError` at startup that names the model and the source.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from pydantic import ValidationError

from trioserve.config import Settings, SettingsError

__all__ = ["CLIENT_NAME_PREFIXES", "ENGINES", "PER_MODEL_SETTINGS", "ModelRegistry", "ModelSpec",
           "RegistryError", "build_registry", "model_paths", "parse_aliases"]

ENGINES = ("llama", "executorch", "fake")

# Route -> name prefixes its clients send by default, served by a lone model.
CLIENT_NAME_PREFIXES: dict[str, tuple[str, ...]] = {"messages": ("claude-",)}

# Settings a model may set for itself (a config file's [models.settings] table): what its
# worker launch and its serving core read. Server-wide settings (host, guard, metrics, ...)
# are not among them.
PER_MODEL_SETTINGS = frozenset({
    "hf_tokenizer_dir", "chatml_fallback", "no_think", "threads", "spill_budget_bytes",
    "swa_cache", "swa_checkpoints", "deterministic", "speculative", "gpu_layers", "fake_script",
    "queue_depth", "cancel_grace", "ready_timeout", "restart", "max_crashes", "crash_window",
    "stall_timeout", "health_timeout", "max_step_ms", "cpu_extra_buffers", "spin_count",
    "profile", "chat_template", "tools_injection", "worker_bin", "worker_args",
    "kv_cache_type", "flash_attn", "stream_interval_ms",
})

# A split GGUF's shard: ``name-00001-of-00003.gguf``.
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-\d{5}\.gguf$")


class RegistryError(SettingsError):
    """The models cannot be served as configured; the message names the model and where it
    was configured."""


# Resolves a model path that is not a local file (``hf:<repo>:<quant>``) to one; raises
# ValueError or OSError with a message for the operator.
PathResolver = Callable[[str], str]


@dataclass(frozen=True)
class ModelSpec:
    """One served model. ``path`` is the GGUF (llama) or ``.pte`` (executorch), empty for the
    fake engine and for the embedded default; ``None`` fields take the server's setting.

    ``pinned`` and ``preload`` are for the load-on-demand host (never unloaded; loaded at
    startup); the simple host loads every model at startup.
    """

    id: str
    engine: str
    path: str = ""
    aliases: tuple[str, ...] = ()
    tokenizer_path: str = ""
    chat_template: str = ""
    profile: str = ""
    context: int | None = None
    slots: int | None = None
    workers: int | None = None
    kv_cache_type: str = ""
    pinned: bool = False
    preload: bool = False
    # Other per-model settings (PER_MODEL_SETTINGS), as (name, value) pairs.
    overrides: tuple[tuple[str, Any], ...] = ()
    source: str = "settings"  # where it was configured, for error messages

    def settings(self, server: Settings) -> Settings:
        """The server's settings with this model's own applied: what its worker launch and
        serving core read (``model_id`` is this model's id).

        Raises:
            RegistryError: a per-model value is out of bounds (named with the model).
        """
        update: dict[str, Any] = {"engine": self.engine, "model_id": self.id,
                                  "model_path": self.path, **dict(self.overrides)}
        named = {"tokenizer_path": self.tokenizer_path, "chat_template": self.chat_template,
                 "profile": self.profile, "max_context": self.context, "slots": self.slots,
                 "workers": self.workers, "kv_cache_type": self.kv_cache_type or None}
        update.update({key: value for key, value in named.items() if value not in (None, "")})
        unknown = sorted(set(update) - set(Settings.model_fields))
        if unknown:  # a per-model key this build of the server has no setting for
            raise RegistryError(f"model {self.id!r} ({self.source}): {', '.join(unknown)} "
                                f"is not supported by this server")
        try:
            return Settings.model_validate(server.model_dump() | update)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            where = ".".join(str(part) for part in error["loc"])
            raise RegistryError(f"model {self.id!r} ({self.source}): {where}: "
                                f"{error['msg']}") from None


@dataclass
class ModelRegistry:
    """The served models (first: the default, which answers requests whose ``model`` cannot
    be read) and the alias patterns, in resolution order (module docstring)."""

    specs: list[ModelSpec]
    aliases: list[tuple[str, str]] = field(default_factory=list)  # (pattern, model id)
    client_model_names: bool = True

    def __post_init__(self) -> None:
        self._by_id = {spec.id: spec for spec in self.specs}

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(spec.id for spec in self.specs)

    @property
    def default(self) -> ModelSpec:
        return self.specs[0]

    def get(self, model_id: str) -> ModelSpec | None:
        return self._by_id.get(model_id)

    def resolve(self, requested: object, route: str = "") -> ModelSpec | None:
        """The model that answers ``requested`` (a body's ``model``) on ``route``
        (``chat``, ``responses``, ``messages``, ``completions``), or None (module docstring)."""
        if not isinstance(requested, str):
            return None
        exact = self._by_id.get(requested)
        if exact is not None:
            return exact
        for pattern, model_id in self.aliases:
            if fnmatch.fnmatchcase(requested, pattern):
                return self._by_id[model_id]
        if (len(self.specs) == 1 and not self.aliases and self.client_model_names
                and requested.startswith(CLIENT_NAME_PREFIXES.get(route, ()))):
            return self.specs[0]
        return None


def model_paths(settings: Settings) -> list[str]:
    """The ``--model-path`` values: repeated flags are joined with newlines; the variable
    separates several with newlines or commas."""
    return [p.strip() for p in re.split(r"[,\n]", settings.model_path) if p.strip()]


def parse_aliases(text: str, source: str = "--model-alias") -> list[tuple[str, str]]:
    """``PATTERN=ID`` entries, separated by commas or newlines (repeated flags are joined
    with newlines), in order.

    Raises:
        RegistryError: an entry without ``=`` or with an empty side.
    """
    out = []
    for entry in re.split(r"[,\n]", text):
        entry = entry.strip()
        if not entry:
            continue
        pattern, sep, model_id = entry.rpartition("=")
        if not sep or not pattern.strip() or not model_id.strip():
            raise RegistryError(f"{source}: {entry!r} is not PATTERN=ID (e.g. 'claude-*haiku*=smollm2')")
        out.append((pattern.strip(), model_id.strip()))
    return out


def build_registry(settings: Settings, *, resolve_path: PathResolver | None = None) -> ModelRegistry:
    """The registry the settings describe (module docstring).

    ``resolve_path`` turns a path that names a hub model (``hf:<repo>:<quant>``) into a local
    file; without it such a path is an error.

    Raises:
        RegistryError: see the module docstring.
    """
    specs: list[ModelSpec] = []
    aliases = parse_aliases(settings.model_alias)
    file_aliases: list[tuple[str, str]] = []
    if settings.models_config:
        found, file_aliases = _from_config(Path(settings.models_config))
        specs += found
    paths = model_paths(settings)
    if settings.models_dir:
        specs += _from_dir(Path(settings.models_dir), f"--models-dir {settings.models_dir}")
    if len(paths) > 1 or (paths and (settings.models_config or settings.models_dir)):
        if settings.model_id and len(paths) > 1:
            raise RegistryError("--model-id names the one --model-path model; with several, "
                                "each takes its file name as id (or use --models-config)")
        specs[:0] = [_from_path(p, settings, settings.model_id if len(paths) == 1 else "")
                     for p in paths]
    elif not specs and paths and paths[0].startswith("hf:"):
        specs = [replace(_from_path(paths[0], settings, settings.model_id), pinned=True, preload=True)]
    elif not specs:
        # The single-model server, exactly as configured by the single-model settings.
        specs = [ModelSpec(id=settings.resolved_model_id(), engine=settings.engine,
                           path=paths[0] if paths else "", tokenizer_path=settings.tokenizer_path,
                           pinned=True, preload=True)]
    elif settings.model_id:
        raise RegistryError("--model-id names the --model-path model; models from "
                            "--models-config or --models-dir have their own ids")
    specs = [_resolved(spec, resolve_path) for spec in specs]
    _check_unique(specs)
    per_model = [(pattern, spec.id) for spec in specs for pattern in spec.aliases]
    registry = ModelRegistry(specs, aliases + per_model + file_aliases,
                             client_model_names=settings.client_model_names)
    for pattern, model_id in registry.aliases:
        if registry.get(model_id) is None:
            raise RegistryError(f"alias {pattern!r} names the model {model_id!r}, which is not "
                                f"served (served: {', '.join(registry.ids)})")
        if pattern in registry.ids and pattern != model_id:
            raise RegistryError(f"alias {pattern!r} is the id of a served model; ids always "
                                f"name their own model")
    for spec in specs:
        _check_files(spec)
        spec.settings(settings)  # per-model values in bounds, named with the model
    return registry


def _resolved(spec: ModelSpec, resolve_path: PathResolver | None) -> ModelSpec:
    if not spec.path.startswith("hf:"):
        return spec
    if resolve_path is None:
        raise RegistryError(f"model {spec.id!r} ({spec.source}): {spec.path!r} names a hub "
                            f"model, and this server has no model pulls configured")
    try:
        return replace(spec, path=resolve_path(spec.path))
    except (ValueError, OSError) as exc:
        raise RegistryError(f"model {spec.id!r} ({spec.source}): {exc}") from None


def _check_unique(specs: list[ModelSpec]) -> None:
    seen: dict[str, ModelSpec] = {}
    for spec in specs:
        if not spec.id:
            raise RegistryError(f"a model from {spec.source} has an empty id")
        if spec.id in seen:
            raise RegistryError(f"two models have the id {spec.id!r}: from {seen[spec.id].source} "
                                f"and from {spec.source}")
        seen[spec.id] = spec


def _check_files(spec: ModelSpec) -> None:
    """A model whose files are missing is refused at startup, not when its worker starts."""
    where = f"model {spec.id!r} ({spec.source})"
    if spec.engine == "fake" or (spec.engine == "llama" and not spec.path):
        return  # the fake engine has no file; llama's default is the embedded model
    if spec.engine == "executorch" and (not spec.path or not spec.tokenizer_path):
        raise RegistryError(f"{where}: the executorch engine needs a .pte path and a tokenizer")
    for name, value in (("path", spec.path), ("tokenizer", spec.tokenizer_path),
                        ("chat_template", spec.chat_template)):
        if value and not Path(value).is_file():
            raise RegistryError(f"{where}: {name} {value!r} is not a file")


def _from_path(text: str, settings: Settings, model_id: str) -> ModelSpec:
    """One ``--model-path``: a file (id: its name without extension) or a model folder."""
    path = Path(text)
    source = f"--model-path {text}"
    if path.is_dir():
        spec = _from_folder(path, source)
        if spec is None:
            raise RegistryError(f"{source}: the folder holds no .gguf or .pte model")
        return replace(spec, id=model_id or spec.id)
    if text.startswith("hf:"):
        stem = text.rsplit("/", 1)[-1].replace(":", "-")
    else:
        stem = path.name.removesuffix(".gguf").removesuffix(".pte")
    return ModelSpec(id=model_id or stem, engine=settings.engine, path=text,
                     tokenizer_path=settings.tokenizer_path, source=source)


def _from_dir(directory: Path, source: str) -> list[ModelSpec]:
    """Every model in ``directory`` (module docstring), sorted by name."""
    if not directory.is_dir():
        raise RegistryError(f"{source}: not a directory")
    specs = []
    for entry in sorted(directory.iterdir()):
        if entry.is_dir():
            spec = _from_folder(entry, f"{source}/{entry.name}")
            if spec is not None:
                specs.append(spec)
        elif entry.suffix == ".gguf" and not entry.name.startswith("mmproj"):
            shard = _SHARD.match(entry.name)
            if shard and int(shard["index"]) != 1:
                continue  # the first shard names the model
            specs.append(ModelSpec(id=shard["stem"] if shard else entry.stem, engine="llama",
                                   path=str(entry), source=f"{source}/{entry.name}"))
    return specs


def _from_folder(folder: Path, source: str) -> ModelSpec | None:
    """A model folder: one ``.pte`` with its ``tokenizer.json`` (executorch), or a GGUF,
    one file or the first shard of a split one (llama). None: no model there."""
    ptes = sorted(folder.glob("*.pte"))
    if ptes:
        if len(ptes) > 1:
            raise RegistryError(f"{source}: several .pte programs; use --models-config to name one")
        tokenizer = folder / "tokenizer.json"
        return ModelSpec(id=folder.name, engine="executorch", path=str(ptes[0]),
                         tokenizer_path=str(tokenizer) if tokenizer.is_file() else "",
                         source=source)
    ggufs = [p for p in sorted(folder.glob("*.gguf")) if not p.name.startswith("mmproj")]
    if not ggufs:
        return None
    firsts = [p for p in ggufs if (m := _SHARD.match(p.name)) and int(m["index"]) == 1]
    if len(firsts) == 1:
        chosen = firsts[0]
    elif len(ggufs) == 1:
        chosen = ggufs[0]
    else:
        raise RegistryError(f"{source}: several GGUF files; use --models-config to name one")
    return ModelSpec(id=folder.name, engine="llama", path=str(chosen), source=source)


# -- the TOML config file -------------------------------------------------------------------

_MODEL_KEYS = {"id": str, "path": str, "engine": str, "aliases": list, "tokenizer": str,
               "chat_template": str, "profile": str, "context": int, "slots": int,
               "workers": int, "kv_cache_type": str, "pinned": bool, "preload": bool,
               "settings": dict}


# Per-model settings that name files: relative to the config file's folder, like 'path'.
_PATH_SETTINGS = frozenset({"hf_tokenizer_dir", "fake_script", "worker_bin"})


def _from_config(path: Path) -> tuple[list[ModelSpec], list[tuple[str, str]]]:
    """The ``[[models]]`` and ``[aliases]`` of a config file; relative paths are relative to
    the file's folder."""
    source = f"--models-config {path}"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RegistryError(f"{source}: cannot read it ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RegistryError(f"{source}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - {"models", "aliases"})
    if unknown:
        raise RegistryError(f"{source}: unknown top-level key(s) {', '.join(unknown)} "
                            f"(expected [[models]] and [aliases])")
    models = data.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise RegistryError(f"{source}: 'models' must be an array of tables ([[models]])")
    table = data.get("aliases", {})
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise RegistryError(f"{source}: [aliases] maps patterns to model ids (strings)")
    specs = [_config_model(entry, index, path.parent, source) for index, entry in enumerate(models)]
    return specs, [(pattern, model_id) for pattern, model_id in table.items()]


def _config_model(entry: Mapping[str, Any], index: int, base: Path, file_source: str) -> ModelSpec:
    model_id = entry.get("id")
    source = f"{file_source}, models[{index}]"
    if not isinstance(model_id, str) or not model_id:
        raise RegistryError(f"{source}: 'id' is required (a non-empty string)")
    for key, value in entry.items():
        kind = _MODEL_KEYS.get(key)
        if kind is None:
            raise RegistryError(f"{source}: unknown key {key!r} (allowed: {', '.join(_MODEL_KEYS)})")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise RegistryError(f"{source}: {key!r} must be a {kind.__name__}, got {value!r}")
    engine = entry.get("engine", "llama")
    if engine not in ENGINES:
        raise RegistryError(f"{source}: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    aliases = entry.get("aliases", [])
    if not all(isinstance(a, str) and a for a in aliases):
        raise RegistryError(f"{source}: 'aliases' must be a list of non-empty strings")
    overrides = dict(entry.get("settings", {}))
    for key in overrides:
        if key not in PER_MODEL_SETTINGS:
            raise RegistryError(f"{source}: [settings] {key!r} is not a per-model setting "
                                f"(allowed: {', '.join(sorted(PER_MODEL_SETTINGS))})")
    for key in _PATH_SETTINGS & set(overrides):
        if isinstance(overrides[key], str) and overrides[key]:
            overrides[key] = str(base / Path(overrides[key]).expanduser())

    def local(key: str) -> str:
        value = str(entry.get(key, ""))
        if not value or value.startswith("hf:"):
            return value
        return str(base / Path(value).expanduser())

    path = local("path")
    if engine != "fake" and not path:
        raise RegistryError(f"{source}: 'path' is required for the {engine} engine")
    return ModelSpec(
        id=model_id, engine=engine, path=path, aliases=tuple(aliases),
        tokenizer_path=local("tokenizer"), chat_template=local("chat_template"),
        profile=entry.get("profile", ""), context=entry.get("context"), slots=entry.get("slots"),
        workers=entry.get("workers"), kv_cache_type=entry.get("kv_cache_type", ""),
        pinned=entry.get("pinned", False), preload=entry.get("preload", False),
        overrides=tuple(sorted(overrides.items())), source=f"{file_source}, model {model_id!r}")
