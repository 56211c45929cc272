"""Every numeric limit of the HTTP contract and the settings, stated once.

spec/README.md §5 (request parameter ranges) and §15 (limits table) describe these values;
``api/chat/validation.py`` validates requests against them, ``config.py`` bounds the settings with them,
and the serving layer relies on them to never send the worker a value it refuses.

Request ranges are chosen so that every accepted value maps to a value the worker accepts
(spec/worker-protocol.md §4): each range is the worker's, narrowed where OpenAI's contract is
narrower (temperature ≤ 2), and the few values the worker cannot represent are mapped by a
rule written here (huge ``top_k``/``max_tokens`` clamp to int32, seeds wrap, ``seed: -1`` means
random) — a well-formed request never reaches the worker with an out-of-range value, so a
worker ``invalid_request`` for a sampling parameter is a bug, not something to blame on the
client's ``messages``.
"""

from __future__ import annotations

__all__ = [
    "INT32_MAX",
    "TEMPERATURE_MIN",
    "TEMPERATURE_MAX",
    "TOP_P_MIN_EXCLUSIVE",
    "TOP_P_MAX",
    "TOP_K_MIN",
    "MAX_TOKENS_MIN",
    "N_MIN",
    "MAX_STOP_STRINGS",
    "SEED_MIN",
    "SEED_MAX",
    "SEED_RANDOM",
    "WORKER_SEED_LIMIT",
    "worker_seed",
    "MAX_JSON_DEPTH",
    "MAX_INTEGER_DIGITS",
    "MAX_CONVERSATION_ITEMS",
    "MAX_BODY_OBJECTS",
    "PORT_MIN",
    "PORT_MAX",
    "QUEUE_DEPTH_MIN",
    "WORKERS_MAX",
    "MAX_CONTEXT_MIN",
    "MAX_BODY_BYTES_MIN",
    "GRAMMAR_CACHE_BYTES",
    "REPLAY_CACHE_BYTES",
    "MAX_PATTERN_CHARS",
]

# The worker's integer fields (top_k, max_new_tokens) are 32-bit.
INT32_MAX = 2**31 - 1

# --- request parameters (spec §5.1, §5.4) -------------------------------------------------

# OpenAI's range. The worker takes any finite value ≥ 0; 0 is greedy.
TEMPERATURE_MIN, TEMPERATURE_MAX = 0.0, 2.0
# (0, 1], the same for the worker; 1 is "off".
TOP_P_MIN_EXCLUSIVE, TOP_P_MAX = 0.0, 1.0
# ≥ 0 (0 is "off"). The worker takes [0, 2^31); larger values are clamped to INT32_MAX, which
# means the same as any value ≥ the vocabulary size: no top-k cut.
TOP_K_MIN = 0
# ≥ 1 for max_tokens and max_completion_tokens. Values above INT32_MAX are clamped to it (the
# worker clamps to the room left in the context anyway, spec §9.1).
MAX_TOKENS_MIN = 1
N_MIN = 1
# At most this many stop strings; the worker matches every one of them at each token.
MAX_STOP_STRINGS = 16

# seed: a request may send any int64 or uint64 (clients use both). The worker takes seeds in
# [0, 2^32 - 1): 2^32 - 1 is llama.cpp's "pick a random seed" sentinel, so it is excluded.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# -1 is what OpenAI-style clients and llama.cpp send to mean "no particular seed".
SEED_RANDOM = -1
WORKER_SEED_LIMIT = 2**32 - 1  # exclusive


def worker_seed(seed: int | None) -> int | None:
    """The worker seed for a request seed in [SEED_MIN, SEED_MAX].

    ``None`` (absent or null) and ``-1`` mean a random seed and give ``None``. Any other value
    ``s`` gives ``s mod (2^32 - 1)`` (Python's ``%``, always in [0, 2^32 - 1)): seeds already
    in the worker's range are unchanged, the rest wrap (``2^32 - 1`` → 0, ``-2`` →
    4294967293). Same request seed ⇒ same worker seed ⇒ same output.
    """
    if seed is None or seed == SEED_RANDOM:
        return None
    return seed % WORKER_SEED_LIMIT


# --- request bodies (spec §4 step 2) --------------------------------------------------------

# Objects and arrays nested deeper than this are invalid_json. Real requests stay far below
# (a tool's JSON Schema nested 20 levels deep is ~45 levels of body); the bound keeps every
# later walk over the body (validation, templates' tojson) far from Python's recursion limit.
MAX_JSON_DEPTH = 64
# Integer literals longer than this are invalid_json. It is Python's own default limit on
# int/str conversion (sys.get_int_max_str_digits(), which bounds the quadratic conversion
# cost); every integer parameter's range fits in 20 digits anyway.
MAX_INTEGER_DIGITS = 4300

# At most this many elements in a request's conversation list (Chat and Messages' messages,
# Responses' input) plus Messages' system blocks. Counted before any per-message work
# (core/turn_floor.py): validating and rendering costs tens of microseconds per element, so
# 100k elements cost seconds of control-plane CPU whatever their text. Real agent sessions
# stay far below (context compaction starts within a few thousand items).
MAX_CONVERSATION_ITEMS = 10_000
# At most this many JSON objects in one request body (content parts, blocks, tools, schemas,
# items: all of them), counted in the same pass: validating costs tens of microseconds per
# object, whichever field holds it. A long agent session with its tools stays below 20,000.
MAX_BODY_OBJECTS = 50_000

# --- settings (spec §15; config.py) -------------------------------------------------------

PORT_MIN, PORT_MAX = 0, 65535  # 0: an ephemeral port
QUEUE_DEPTH_MIN = 0  # 0: no request waits; one beyond the running ones is 503
# Workers of one server (--workers): each is a process with its own model copy; more than
# this on one host is a typo, not a deployment.
WORKERS_MAX = 64
# Below this no chat template plus a reply fits; it catches typos like "--max-context 4".
MAX_CONTEXT_MIN = 16
# Below 1 KiB not even a minimal chat request with a short system prompt fits.
MAX_BODY_BYTES_MIN = 1024

# --- caches (spec §17.4: every cache, its bound and its gauge) ---------------------------------

# Compiled grammars kept for reuse (core/constraints.py GrammarCache), one per server: the
# grammar text and description of each accepted constraint, keyed by a digest. A grammar is at
# most 1 MiB (constraints.MAX_GRAMMAR_BYTES), so this keeps at least 32 of the largest and
# thousands of ordinary ones; compiling a missing one again costs milliseconds.
GRAMMAR_CACHE_BYTES = 32 * 1024 * 1024
# Remembered assistant turns per session key (core/replay.py ReplayStore), per model: each
# turn's generated token ids and its text signature. Filled by finished generations only.
REPLAY_CACHE_BYTES = 64 * 1024 * 1024
# A JSON Schema ``pattern`` is checked by compiling it with ``re``, whose module-level cache
# keeps the last 512 compiled patterns whoever sent them (a refused request's too). At most this
# many characters a pattern keeps that cache near 12 MB (measured: 512 patterns of 4 KiB); a
# 140 KB pattern held 1.1 MB there. Real patterns are far shorter, and a longer one's grammar
# would near constraints.MAX_GRAMMAR_BYTES anyway.
MAX_PATTERN_CHARS = 4096
