"""Model references on the Hugging Face Hub: ``hf:<repo>[:<quant or file>]`` → a local GGUF.

A leaf (it imports no trioserve layer): the CLI's ``trioserve pull`` / ``trioserve models`` and
the settings' ``--model-path hf:...`` both go through :func:`resolve_model_ref`. Everything that
touches the Hub or its cache is the Hub's own client library, ``huggingface_hub``: the endpoint
(``HF_ENDPOINT``), the token, the standard cache (``HF_HOME`` / ``HF_HUB_CACHE``, shared with
every other Hugging Face tool) and its layout, offline mode (``HF_HUB_OFFLINE=1``).

Two things the library's ``hf_hub_download`` does not do, and this module adds:

- **Resume across pulls.** The library resumes a dropped connection inside one call (a Range
  request), but it deletes its partial file when the call fails, so an interrupted pull
  (Ctrl-C, a network outage longer than its retries) starts from zero. Here the bytes go to
  ``blobs/<etag>.trioserve-partial`` in the repo's cache folder, through the library's own
  ``http_get`` with ``resume_size``, so the next pull asks for the rest with a Range request.
- **Checksums.** The library checks only the size of what it downloaded. Here the finished
  file is hashed and compared with the Hub's ETag for it (the sha256 of an LFS file, the git
  blob sha1 of a small file) *before* it becomes the cache's blob; a mismatch deletes it and
  fails with :class:`HubError`, so a corrupt file is never kept or served.
- **Paths that stay in the cache.** Every part of a cache path that comes from the command line
  (repo id, revision) or from the network (a file name in the listing, the ETag, the commit) is
  checked before anything is written (:func:`check_revision`, :func:`parse_model_ref` and the
  checks in :func:`_download_file`); the library, which joins them as given, is only asked to
  read the cache. So this module writes the blob, the snapshot link and the ref itself, in the
  library's layout. A refused reference or revision is :class:`HubRefError` (the CLI's exit 2).

Blocking I/O: call it before the event loop starts (the CLI does) or in a worker thread.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("trioserve.hub")

PREFIX = "hf:"
PARTIAL_SUFFIX = ".trioserve-partial"
# llama.cpp's split GGUF naming: <prefix>-00001-of-00003.gguf, loaded from the first part.
_SPLIT = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# What llama.cpp's -hf picks when a repo holds several quantisations and none is named.
DEFAULT_QUANT = "Q4_K_M"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")


class HubError(Exception):
    """A model reference cannot be resolved: malformed, not on the Hub, ambiguous, not in the
    cache in offline mode, or a download failed its checksum. The message says what to do."""


class HubRefError(HubError):
    """What the user typed is not a reference or a revision (a usage error: nothing was
    asked of the Hub and nothing written)."""


# The Hub's repo names: ASCII letters, digits, '.', '_', '-'; at most 96 characters a part
# (huggingface_hub's own validate_repo_id); '--' and '..' are refused there too.
_REPO_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,95}")
MAX_REPO_PART = 96
# A branch, tag or commit: git's ref characters, in path components (``refs/pr/1``).
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]*(/[A-Za-z0-9_][A-Za-z0-9._+-]*)*")
MAX_REVISION = 255
# A blob name from the network: one path component (the Hub's are hex digests).
_ETAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
MAX_FILENAME = 1024


def _shown(text: str) -> str:
    """``text`` for a one-line message: repr'd, at most 100 characters of it."""
    return repr(text[:100]) + (f" (… {len(text)} characters)" if len(text) > 100 else "")


def check_revision(revision: str) -> str:
    """``revision`` when it can name a branch, tag or commit and be a path under the cache's
    ``refs`` folder: git's ref characters in ``/``-separated components, none empty or starting
    with a dot, at most :data:`MAX_REVISION` characters.

    Raises:
        HubRefError: anything else (``../../y``, ``/etc``, an empty one), saying so.
    """
    if len(revision) > MAX_REVISION or not _REVISION.fullmatch(revision) or ".." in revision \
            or revision.endswith(".lock"):
        raise HubRefError(f"not a revision: {_shown(revision)} (a branch, tag or commit: letters, "
                          "digits, '.', '_', '-', '+' in '/'-separated parts, e.g. main, v1.0, "
                          "refs/pr/1 or a 40-digit commit)")
    return revision


def _check_filename(ref: ModelRef, name: str) -> str:
    """A file name from the Hub's listing, before it becomes a path under a snapshot: relative,
    ``/``-separated, no empty, ``.`` or ``..`` part, no backslash or control character."""
    parts = name.split("/")
    if (not name or len(name) > MAX_FILENAME or any(p in ("", ".", "..") for p in parts)
            or "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name)):
        raise HubError(f"{ref}: the Hub lists a file name that is not a path inside the repo: "
                       f"{_shown(name)}; nothing was written")
    return name


@dataclass(frozen=True)
class ModelRef:
    """A parsed ``hf:<repo>[:<selector>]``: the selector is a file name (ends in ``.gguf``),
    a quantisation name (``Q4_K_M``), or empty (the repo's only GGUF, else its Q4_K_M)."""

    repo_id: str
    selector: str = ""

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo_id}" + (f":{self.selector}" if self.selector else "")


def is_model_ref(path: str) -> bool:
    """Whether a model path names a Hub model (``hf:...``) rather than a local file."""
    return path.startswith(PREFIX)


def parse_model_ref(ref: str) -> ModelRef:
    """``hf:owner/name:Q4_K_M`` (the ``hf:`` is optional: ``trioserve pull`` takes the bare
    form) → :class:`ModelRef`.

    Raises:
        HubError: not ``owner/name`` with an optional ``:selector``.
    """
    text = ref[len(PREFIX):] if ref.startswith(PREFIX) else ref
    repo_id, _, selector = text.partition(":")
    parts = repo_id.split("/")
    if (len(parts) != 2 or not all(_REPO_PART.fullmatch(p) for p in parts)
            or ".." in repo_id or "--" in repo_id or ":" in selector or len(selector) > MAX_FILENAME
            or any(ord(c) < 32 or ord(c) == 127 for c in selector)):
        raise HubRefError(f"not a Hub model reference: {_shown(ref)} (expected hf:<owner>/<repo>"
                          "[:<quant or file.gguf>], each name at most 96 letters, digits, '.', '_' "
                          "or '-', e.g. hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M)")
    return ModelRef(repo_id, selector)


def offline_from_env() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as the library reads it, at call time."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def cache_dir() -> Path:
    """The Hub cache this process uses (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``), as the library resolved it at import."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


# -- choosing files ---------------------------------------------------------------------


def _model_ggufs(files: list[str]) -> list[str]:
    """The GGUF files that are models (not a vision projector) in a repo listing."""
    return sorted(f for f in files if f.lower().endswith(".gguf")
                  and not Path(f).name.lower().startswith("mmproj"))


def _split_group(name: str) -> str:
    """Files of one split GGUF share a group key; any other file is its own group."""
    match = _SPLIT.match(name)
    return match["prefix"] if match else name


def select_files(ref: ModelRef, files: list[str]) -> list[str]:
    """The file(s) of ``files`` (a repo listing) that ``ref`` names: one GGUF, or every part of
    a split GGUF (first part first).

    Raises:
        HubError: nothing matches, or several models do; the message lists the GGUF files.
    """
    ggufs = _model_ggufs(files)
    if ref.selector.lower().endswith(".gguf"):
        chosen = [f for f in files if f == ref.selector or Path(f).name == ref.selector]
        if not chosen:
            raise HubError(f"{ref}: no file {ref.selector!r} in the repo; its GGUF files: "
                           f"{_listing(ggufs)}")
        chosen = chosen[:1]
        group = _split_group(chosen[0])
        if _SPLIT.match(chosen[0]):
            chosen = [f for f in ggufs if _split_group(f) == group]
        return sorted(chosen)
    if not ggufs:
        raise HubError(f"{ref}: the repo has no GGUF model files (files: {_listing(files)})")
    pattern = f"*{ref.selector or DEFAULT_QUANT}*.gguf".lower()
    matches = [f for f in ggufs if fnmatch.fnmatch(Path(f).name.lower(), pattern)]
    groups = {_split_group(f) for f in matches}
    if not ref.selector and len({_split_group(f) for f in ggufs}) == 1:
        return ggufs  # the repo's only model, whatever its quantisation
    if len(groups) == 1:
        return matches
    what = f"quantisation {ref.selector!r}" if ref.selector else \
        f"no quantisation given (and no single {DEFAULT_QUANT} file)"
    problem = "matches several models" if groups else "matches no file"
    raise HubError(f"{ref}: {what} {problem}; name one with hf:{ref.repo_id}:<quant or "
                   f"file.gguf>. The repo's GGUF files: {_listing(ggufs)}")


def _listing(files: list[str]) -> str:
    return ", ".join(files) if files else "(none)"


# -- progress ------------------------------------------------------------------------------


class LogProgress:
    """A tqdm stand-in for logs (stderr is not a terminal): a line when a download starts,
    every 10% (at most every 2 s, at least every 30 s) and when it ends, instead of a bar
    redrawn with carriage returns. The library builds it with tqdm's keyword arguments."""

    def __init__(self, *, total: int | None = None, initial: int = 0, desc: str = "",
                 **_: Any) -> None:
        self.total, self.n, self.desc = total, initial, desc
        self._last_time = time.monotonic()
        self._last_decile = self._decile()
        log.info("pull %s: %s", desc, self._amount() + (" (resuming)" if initial else ""))

    def _decile(self) -> int:
        return self.n * 10 // self.total if self.total else 0

    def _amount(self) -> str:
        if not self.total:
            return size_text(self.n)
        return f"{size_text(self.n)} of {size_text(self.total)} ({self.n * 100 // self.total}%)"

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        decile = self._decile()
        if (decile != self._last_decile and now - self._last_time >= 2.0) \
                or now - self._last_time >= 30.0:
            self._last_time, self._last_decile = now, decile
            log.info("pull %s: %s", self.desc, self._amount())

    def close(self) -> None:
        log.info("pull %s: %s done", self.desc, self._amount())

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:
            self.close()


def size_text(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 MiB`` (the CLI's model table, progress)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _progress_class(progress: bool | None) -> Any:
    """A bar on a terminal, log lines otherwise (``progress`` None: decide by stderr)."""
    from huggingface_hub.utils.tqdm import tqdm as hub_tqdm

    on_terminal = sys.stderr.isatty() if progress is None else progress
    return hub_tqdm if on_terminal else LogProgress


# -- downloading -----------------------------------------------------------------------------


def _checksum_kind(etag: str) -> str | None:
    """The Hub's ETag for a file is its sha256 when the file is in LFS (every GGUF), else its
    git blob sha1; anything else cannot be checked."""
    if _SHA256.match(etag):
        return "sha256"
    if _SHA1.match(etag):
        return "git-sha1"
    return None


def _digest(path: Path, kind: str) -> str:
    size = path.stat().st_size
    hasher = hashlib.sha256() if kind == "sha256" else hashlib.sha1(f"blob {size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            hasher.update(chunk)
    return hasher.hexdigest()


def _download_file(ref: ModelRef, filename: str, revision: str, cache: Path,
                   progress: bool | None) -> Path:
    """Put ``filename`` into the cache (resuming a partial blob), verified, in the library's
    layout: ``blobs/<etag>``, ``snapshots/<commit>/<filename>`` linking to it, and
    ``refs/<revision>`` naming the commit; returns the snapshot path.

    Every path part is checked before anything is written (module docstring): ``revision``
    (:func:`check_revision`) and ``filename`` (:func:`_check_filename`) by the caller, the ETag
    and the commit the Hub answers here; a bad one is a HubError and nothing is written."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import repo_folder_name

    url = hf_hub_url(ref.repo_id, filename, revision=revision)
    meta = get_hf_file_metadata(url)
    if meta.etag is None or meta.commit_hash is None:
        raise HubError(f"{ref}: the Hub's answer for {filename} has no ETag or commit "
                       "(is HF_ENDPOINT a Hugging Face Hub?)")
    if not _ETAG.fullmatch(meta.etag) or ".." in meta.etag:
        raise HubError(f"{ref}: the Hub's ETag for {filename} is not a blob name: "
                       f"{_shown(meta.etag)}; nothing was written")
    if not _COMMIT.fullmatch(meta.commit_hash):
        raise HubError(f"{ref}: the Hub's commit for {filename} is not a 40-digit commit: "
                       f"{_shown(meta.commit_hash)}; nothing was written")
    storage = cache / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    blob = storage / "blobs" / meta.etag
    pointer = storage / "snapshots" / meta.commit_hash / filename
    ref_file = storage / "refs" / revision
    for path in (blob, pointer, ref_file):  # the checks above make this hold; make sure
        if os.path.commonpath([storage, os.path.normpath(path)]) != str(storage):
            raise HubError(f"{ref}: {_shown(str(path))} is outside the cache; nothing was written")
    if not (blob.exists() or pointer.exists()):
        _download_blob(ref, filename, meta, blob, url, progress)
    if not pointer.exists() and not pointer.is_symlink():
        pointer.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    if revision != meta.commit_hash:
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        if not ref_file.is_file() or ref_file.read_text() != meta.commit_hash:
            temporary = ref_file.with_name(ref_file.name + PARTIAL_SUFFIX)
            temporary.write_text(meta.commit_hash)
            os.replace(temporary, ref_file)
    return pointer


def _download_blob(ref: ModelRef, filename: str, meta: Any, blob: Path, url: str,
                   progress: bool | None) -> None:
    """Download ``blob`` (resuming its partial file) and verify it against the ETag."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]  # public, lazily exported

    blob.parent.mkdir(parents=True, exist_ok=True)
    partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
    resume = partial.stat().st_size if partial.exists() else 0
    if meta.size is not None and resume > meta.size:  # not a prefix of this file: start over
        partial.unlink()
        resume = 0
    headers = build_hf_headers()
    if urlparse(meta.location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a signed CDN URL; never send the token there
    with partial.open("ab") as out:
        http_get(meta.location, out, resume_size=resume, headers=headers,
                 expected_size=meta.size, displayed_filename=filename,
                 tqdm_class=_progress_class(progress))
    kind = _checksum_kind(meta.etag)
    if kind is not None:
        actual = _digest(partial, kind)
        if actual != meta.etag:
            partial.unlink()
            raise HubError(f"{ref}: {filename} failed its checksum ({kind} {actual}, the Hub "
                           f"says {meta.etag}); the download was deleted, pull again")
    else:
        log.warning("pull %s: the Hub's ETag %r is not a checksum; %s is kept unverified",
                    ref, meta.etag, filename)
    os.replace(partial, blob)


def _repo_files(ref: ModelRef, revision: str) -> list[str]:
    from huggingface_hub import HfApi

    info = HfApi().model_info(ref.repo_id, revision=revision)
    return [s.rfilename for s in info.siblings or []]


def _cached_files(ref: ModelRef, revision: str) -> list[str]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(ref.repo_id, revision=revision, local_files_only=True,
                                          cache_dir=cache_dir()))
    except LocalEntryNotFoundError:
        raise HubError(f"{ref}: not in the Hugging Face cache ({cache_dir()}) and offline "
                       f"(HF_HUB_OFFLINE=1): pull it first with 'trioserve pull {ref}' while "
                       "online") from None
    return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())


def resolve_model_ref(ref: str, *, offline: bool, revision: str = "main",
                      progress: bool | None = None) -> Path:
    """The local path of the GGUF that ``ref`` (``hf:<repo>[:<quant or file.gguf>]``) names,
    downloaded into the Hugging Face cache unless it is there already.

    Online, the repo's listing picks the file(s) (every part of a split GGUF; the returned path
    is the first part, which llama.cpp loads the others beside), each is downloaded with resume
    and checked against the Hub's checksum (see the module docstring), and the cache's snapshot
    path is returned. Offline (``offline=True``; callers pass :func:`offline_from_env`), only
    the cache is read and nothing is requested. A Hub that cannot be reached (no network, a
    proxy) falls back to the cache with a warning, as the library's own downloads do.

    Args:
        ref: the reference; the ``hf:`` prefix is optional.
        offline: read only the cache.
        revision: branch, tag or commit on the Hub.
        progress: a bar (True), log lines (False), or by whether stderr is a terminal (None).

    Raises:
        HubRefError: ``ref`` or ``revision`` is malformed (nothing asked, nothing written).
        HubError: every other failure (repo or file not found, ambiguous quantisation, not
            cached while offline, network failure, checksum mismatch, a path part from the Hub
            that would leave the cache), with what to do.
    """
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    parsed = parse_model_ref(ref)
    check_revision(revision)
    cache = cache_dir()
    try:
        return _resolve(parsed, revision, offline, progress, cache)
    except LocalEntryNotFoundError as exc:
        raise HubError(f"{parsed}: not in the Hugging Face cache ({cache}) while offline: "
                       f"{exc}") from None
    except HFValidationError as exc:  # the library's own checks, should ours ever pass more
        raise HubRefError(f"{parsed}: {_first_line(exc)}") from None
    except HfHubHTTPError as exc:
        raise HubError(f"{parsed}: the Hub refused: {_first_line(exc)}") from None
    except OSError as exc:  # the library's own I/O and consistency errors
        raise HubError(f"{parsed}: download failed: {exc}") from None
    except Exception as exc:  # httpx transport errors, after the library's own retries
        if type(exc).__module__.split(".")[0] not in ("httpx", "httpx2", "httpcore"):
            raise
        unreachable = f"cannot reach the Hub ({_endpoint()}): {_first_line(exc)}"
    # Unreachable (no network, a proxy, the Hub down): what the cache holds still serves, as the
    # library's own hf_hub_download falls back to it.
    try:
        path = _resolve(parsed, revision, True, progress, cache)
    except (HubError, LocalEntryNotFoundError):
        raise HubError(f"{parsed}: {unreachable}, and it is not in the Hugging Face cache "
                       f"({cache})") from None
    log.warning("%s: %s; using the cached %s", parsed, unreachable, path)
    return path


def _resolve(parsed: ModelRef, revision: str, offline: bool, progress: bool | None,
             cache: Path) -> Path:
    from huggingface_hub import hf_hub_download

    files = _cached_files(parsed, revision) if offline else _repo_files(parsed, revision)
    # Every chosen name is checked before the first byte is written (a split GGUF's parts too).
    chosen = [_check_filename(parsed, f) for f in select_files(parsed, files)]
    if offline:
        return Path(hf_hub_download(parsed.repo_id, chosen[0], revision=revision,
                                    cache_dir=cache, local_files_only=True))
    return [_download_file(parsed, f, revision, cache, progress) for f in chosen][0]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


# -- what is cached -----------------------------------------------------------------------


@dataclass(frozen=True)
class CachedModel:
    """One GGUF file in the Hub cache."""

    repo_id: str
    filename: str
    size: int
    path: Path
    refs: tuple[str, ...]

    @property
    def ref(self) -> str:
        return f"{PREFIX}{self.repo_id}:{Path(self.filename).name}"


def cached_models() -> list[CachedModel]:
    """Every GGUF model file in the Hub cache (every revision), by repo and file name."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir())
    except CacheNotFound:
        return []
    found = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            names = [str(f.file_path.relative_to(revision.snapshot_path)) for f in revision.files]
            sizes = {str(f.file_path.relative_to(revision.snapshot_path)): f for f in revision.files}
            for name in _model_ggufs(names):
                entry = sizes[name]
                found.append(CachedModel(repo.repo_id, name, entry.size_on_disk, entry.file_path,
                                         tuple(sorted(revision.refs))))
    return sorted(found, key=lambda m: (m.repo_id, m.filename))
