"""The worker pool's routing policy (worker/routing.py) and the per-worker settings."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from trioserve.config import Settings
from trioserve.worker.protocol import GenerateParams, IdsSegment, TextSegment
from trioserve.worker.launch import argv_for, env_for
from trioserve.worker.routing import (
    MIN_SHARED_PREFIX_CHARS,
    Load,
    ResidentPrefixes,
    choose_anonymous,
    common_prefix_len,
    key_order,
    prompt_text,
)


def test_key_order_is_a_permutation_and_the_same_in_another_process():
    keys = [f"session-{i}" for i in range(50)] + ["ünïcode", "\ud800-lone"]
    here = [key_order(key, 5) for key in keys]
    assert all(sorted(order) == list(range(5)) for order in here)
    # A fresh interpreter with another hash seed: salted hash() would disagree.
    code = ("import json,sys; from trioserve.worker.routing import key_order; "
            "keys=json.loads(sys.stdin.read()); print(json.dumps([key_order(k, 5) for k in keys]))")
    import json
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(keys), env=env,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == here


def test_keys_spread_and_a_new_worker_takes_keys_only_for_itself():
    keys = [f"k{i}" for i in range(2000)]
    first = [key_order(k, 4)[0] for k in keys]
    for worker in range(4):
        assert 0.18 < first.count(worker) / len(keys) < 0.32
    grown = [key_order(k, 5)[0] for k in keys]
    moved = [(a, b) for a, b in zip(first, grown) if a != b]
    assert moved and all(b == 4 for _, b in moved)  # only to the new worker


def test_common_prefix_len_matches_a_char_by_char_count():
    rng = random.Random(7)
    for _ in range(300):
        base = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 60)))
        a = base + "".join(rng.choice("abc") for _ in range(rng.randrange(0, 5)))
        b = base + "".join(rng.choice("abc") for _ in range(rng.randrange(0, 5)))
        assert common_prefix_len(a, b) == len(os.path.commonprefix([a, b]))


def test_prompt_text_keeps_ids_apart_from_text():
    text = prompt_text(GenerateParams(prompt="hello"))
    assert text == "hello"
    segs = prompt_text(GenerateParams(prompt_segments=(TextSegment("12"), IdsSegment((1, 2)))))
    assert segs.startswith("12") and segs != prompt_text(GenerateParams(prompt="121,2"))


def test_resident_prefixes_remember_recent_prompts_and_follow_a_conversation():
    held = ResidentPrefixes(limit=2)
    held.add("system: be brief. user: one")
    held.add("system: be brief. user: one. assistant: 1. user: two")  # replaces its prefix
    held.add("something else")
    assert held.longest("system: be brief. user: one. assistant: 1. user: two. more") == len(
        "system: be brief. user: one. assistant: 1. user: two")
    held.add("a third prompt")  # the limit pushes the oldest out
    assert held.longest("system: be brief. user: one. assistant: 1") == 1  # the "s" of "something"
    assert held.longest("something else entirely") == len("something else")
    held.clear()
    assert held.longest("something else") == 0


LONG = MIN_SHARED_PREFIX_CHARS


@pytest.mark.parametrize("loads, shared, expected", [
    # No shared prefix worth the name: the least loaded (ties: lowest index).
    ([Load(0, 1, 4), Load(1, 0, 4)], {0: LONG - 1}, 1),
    ([Load(0, 0, 4), Load(1, 0, 4)], {}, 0),
    # A long shared prefix wins over load while its worker has a free slot.
    ([Load(0, 0, 4), Load(1, 3, 4)], {1: LONG}, 1),
    # ... but not when it is full and another worker has room.
    ([Load(0, 0, 4), Load(1, 4, 4)], {1: LONG * 4}, 0),
    # Full everywhere: stay with the prefix (it queues where its state is).
    ([Load(0, 5, 4), Load(1, 4, 4)], {0: LONG}, 0),
    # Load is per slot: 2 of 8 is less loaded than 1 of 2.
    ([Load(0, 1, 2), Load(1, 2, 8)], {}, 1),
    # The least loaded worker holds as much of the prefix: it wins.
    ([Load(0, 2, 4), Load(1, 0, 4)], {0: LONG, 1: LONG}, 1),
])
def test_choose_anonymous(loads, shared, expected):
    assert choose_anonymous(loads, shared) == expected


def test_one_worker_is_always_chosen():
    assert choose_anonymous([Load(0, 9, 1)], {0: 0}) == 0
    assert key_order("any", 1) == [0]


def test_workers_share_the_cpus_and_get_one_gpu_each(monkeypatch):
    monkeypatch.setattr("trioserve.config.usable_cpus", lambda: 8)
    one = Settings(engine="fake")
    assert one.worker_threads() == 8
    assert Settings(engine="fake", workers=3).worker_threads() == 2
    assert Settings(engine="fake", workers=16).worker_threads() == 1
    assert Settings(engine="fake", workers=3, threads=5).worker_threads() == 5  # per worker
    # One worker (or no GPU offload): the server's devices are inherited unchanged.
    assert "CUDA_VISIBLE_DEVICES" not in env_for(one, 0, base={})
    assert "CUDA_VISIBLE_DEVICES" not in env_for(Settings(engine="fake", workers=2), 1, base={})
    gpu = Settings(engine="fake", workers=3, gpu_layers=99)
    assert [env_for(gpu, i, base={})["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["0", "1", "2"]
    base = {"CUDA_VISIBLE_DEVICES": "4, 6"}
    assert [env_for(gpu, i, base=base)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["4", "6", "4"]


def test_workers_setting_bounds():
    from trioserve.config import SettingsError
    assert Settings.from_env({"TRIOSERVE_WORKERS": "4"}).workers == 4
    for bad in ("0", "-1", "65", "two"):
        with pytest.raises(SettingsError, match="TRIOSERVE_WORKERS"):
            Settings.from_env({"TRIOSERVE_WORKERS": bad})


def test_workers_share_the_default_kv_budget(monkeypatch):
    monkeypatch.setattr("trioserve.worker.launch.physical_memory_bytes", lambda: 16 << 30)
    monkeypatch.setattr("trioserve.config.Settings.resolved_model_path", lambda self: "m.gguf")
    monkeypatch.setattr("trioserve.worker.launch.installed_worker", lambda engine: "worker")
    one = argv_for(Settings(engine="llama", threads=1))
    assert "--kv-budget-bytes" not in one  # one worker: the worker's own default
    argv = argv_for(Settings(engine="llama", threads=1, workers=4))
    assert argv[argv.index("--kv-budget-bytes") + 1] == str((16 << 30) // 4 // 4)
    fixed = argv_for(Settings(engine="llama", threads=1, workers=4, max_context=2048))
    assert "--kv-budget-bytes" not in fixed  # an explicit context needs no budget
