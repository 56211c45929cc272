"""The persistent state store's files, read from Python: ``trioserve state list|purge``.

The worker writes them (cpp/state_store.h; the format is spec/worker-protocol.md §6.4): one
``<fp>-<key>.tss`` file per saved state, a header — magic ``TRIOSTAT``, format version,
fingerprint, session key, token ids, body length and checksum, header checksum — then the
engine's state bytes. This module reads headers only (never a body), and never follows a
symlink: it lists what a directory holds and removes it, nothing else.
"""

from __future__ import annotations

import argparse
import os
import stat
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = ["StateFile", "add_state_command", "purge", "read_header", "run_state_command", "scan"]

MAGIC = b"TRIOSTAT"
FORMAT_VERSION = 1
SUFFIX = ".tss"
TEMP_PREFIX = ".tmp-"
# A temp file older than this is a crashed writer's (the worker's bound pass uses the same age).
STALE_TEMP_S = 600
_MASK = (1 << 64) - 1


def state_hash(data: bytes, seed: int = 0) -> int:
    """The worker's checksum (state_hash in cpp/state_store.h), bit for bit."""
    h = 0xCBF29CE484222325 ^ seed
    words = len(data) // 8
    for (w,) in struct.iter_unpack("<Q", data[: words * 8]):
        h = ((h ^ w) * 0x100000001B3) & _MASK
        h ^= h >> 29
    for b in data[words * 8:]:
        h = ((h ^ b) * 0x100000001B3) & _MASK
    h ^= len(data)
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK
    return h ^ (h >> 33)


@dataclass(frozen=True)
class StateFile:
    """One file of the store as its header describes it; ``problem`` says why it is unusable."""

    name: str
    size: int
    mtime: float
    fingerprint: str = ""
    session: str = ""
    tokens: int = 0
    problem: str | None = None


def read_header(path: Path) -> StateFile:
    """The header of ``path`` (never its body); a file that is not a readable state file of
    this format comes back with ``problem`` set."""
    st = path.lstat()
    base = StateFile(path.name, st.st_size, st.st_mtime)
    if not stat.S_ISREG(st.st_mode):
        return _bad(base, "not a regular file")
    with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            return _bad(base, "not a state file")
        version, fp_len = struct.unpack("<II", head[8:16])
        if version != FORMAT_VERSION:
            return _bad(base, f"format version {version}")
        data = bytearray(head)
        try:
            fingerprint = _take(f, data, fp_len).decode("utf-8", "replace")
            session = _take(f, data, struct.unpack("<I", _take(f, data, 4))[0]).decode("utf-8", "replace")
            n_tokens = struct.unpack("<I", _take(f, data, 4))[0]
            _take(f, data, 4 * n_tokens + 16)
            body_len = struct.unpack("<Q", data[-16:-8])[0]
            (header_hash,) = struct.unpack("<Q", _take(f, bytearray(), 8))
        except ValueError as exc:
            return _bad(base, str(exc))
    if header_hash != state_hash(bytes(data)):
        return _bad(base, "header checksum mismatch")
    full = StateFile(path.name, st.st_size, st.st_mtime, fingerprint, session, n_tokens)
    if st.st_size != len(data) + 8 + body_len:
        return _bad(full, "file size is not the header's (truncated?)")
    return full


def _take(f: BinaryIO, data: bytearray, n: int) -> bytes:
    chunk = f.read(n)
    if len(chunk) != n:
        raise ValueError("truncated header")
    data += chunk
    return chunk


def _bad(f: StateFile, problem: str) -> StateFile:
    return StateFile(f.name, f.size, f.mtime, f.fingerprint, f.session, f.tokens, problem)


def scan(directory: Path) -> list[StateFile]:
    """Every ``*.tss`` entry of ``directory``, least recently used first (the worker's order of
    dropping them). Raises OSError when the directory cannot be read."""
    files = [read_header(p) for p in directory.iterdir() if p.name.endswith(SUFFIX)]
    return sorted(files, key=lambda f: f.mtime)


def purge(directory: Path, session: str | None = None) -> tuple[int, int]:
    """Removes every state file (only ``session``'s and its branches', when given) and crashed
    writers' temp files; returns (files, bytes) removed. A file another process removed
    meanwhile is skipped."""
    removed = freed = 0
    for f in scan(directory):
        if session is not None and f.session != session and not f.session.startswith(session + "\x1f"):
            continue
        if _unlink(directory / f.name):
            removed, freed = removed + 1, freed + f.size
    if session is None:
        for p in directory.iterdir():
            if p.name.startswith(TEMP_PREFIX) and time.time() - p.lstat().st_mtime > STALE_TEMP_S:
                _unlink(p)
    return removed, freed


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def add_state_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``trioserve state list|purge --state-dir DIR [--session KEY]``."""
    cmd = commands.add_parser(
        "state", help="list or purge the persistent state store",
        description="List the saved states in a --state-dir (least recently used first: the "
                    "order the bound drops them) or remove them. Safe while servers use the "
                    "directory: a removed state is computed again when next needed.")
    cmd.add_argument("action", choices=("list", "purge"))
    cmd.add_argument("--state-dir", default=os.environ.get("TRIOSERVE_STATE_DIR", ""),
                     help="the directory [TRIOSERVE_STATE_DIR]")
    cmd.add_argument("--session", default=None, help="purge: only this session key's states")


def run_state_command(args: argparse.Namespace) -> int:
    """Runs ``trioserve state``; exit 2 without a directory, 1 when it cannot be read."""
    if not args.state_dir:
        print("trioserve: state needs --state-dir DIR (or TRIOSERVE_STATE_DIR)", file=sys.stderr)
        return 2
    directory = Path(args.state_dir).expanduser()
    try:
        if args.action == "purge":
            removed, freed = purge(directory, args.session)
            print(f"removed {removed} state files ({freed} bytes) from {directory}")
            return 0
        files = scan(directory)
    except OSError as exc:
        print(f"trioserve: {directory}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print("FILE\tBYTES\tLAST USED\tSESSION\tTOKENS\tMODEL\tSTATUS")
    for f in files:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.mtime))
        session = f.session.replace("\x1f", "#") or "-"
        print(f"{f.name}\t{f.size}\t{used}\t{session}\t{f.tokens}\t{f.fingerprint or '-'}\t{f.problem or 'ok'}")
    print(f"{len(files)} files, {sum(f.size for f in files)} bytes")
    return 0
