"""The load-on-demand host (trioserve/http/on_demand_host.py) as built, before anything runs:
every model's parts exist up front, each with its own pool; nothing is loaded; a lone model is
pinned; the pinned models' fit is checked. Loads, leases and unloads over real fake workers are
tests/http/models/test_models_on_demand.py's; the lifecycle's rules are tests/unit/worker/
test_lifecycle.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trioserve.config import Settings
from trioserve.errors import APIError
from trioserve.registry import RegistryError
from trioserve.http.on_demand_host import measured_cost
from trioserve.http.services import build_services


def services(tmp_path, models: str = "[[models]]\nid = 'a'\nengine = 'fake'\n"
                                     "[[models]]\nid = 'b'\nengine = 'fake'\n", **settings):
    config = tmp_path / "models.toml"
    config.write_text(models)
    return build_services(Settings(models_config=str(config), worker_bin="/w", **settings))


def test_models_are_built_up_front_each_with_its_own_pool_and_none_is_loaded(tmp_path):
    built = services(tmp_path)
    host = built.host
    assert host.loaded() == [] and (host.state("a"), host.state("b")) == ("not_loaded", "not_loaded")
    assert host.services("a").pool is not host.services("b").pool
    assert built.model_id == "a" and built.default.pool is host.services("a").pool  # the default
    assert host.services("b").core.names.serves("b", "chat")
    assert not host.services("b").core.names.serves("a", "chat")
    assert not host.pinned("a") and not host.fatal


def test_a_lone_model_is_pinned(tmp_path):
    host = services(tmp_path, "[[models]]\nid = 'only'\nengine = 'fake'\n").host
    assert host.pinned("only")


def test_pinned_models_that_do_not_fit_the_budget_together_are_a_startup_error(tmp_path):
    # A fake model costs 4 bytes a token of context per slot: 4 x 1024 x 2 = 8 KiB each.
    models = "".join(f"[[models]]\nid = '{m}'\nengine = 'fake'\ncontext = 1024\nslots = 2\n"
                     "pinned = true\n" for m in "ab")
    with pytest.raises(RegistryError, match="pinned models .a, b. need about 16384 bytes"):
        services(tmp_path, models, memory_budget_bytes=12_000)


async def test_a_lease_while_the_host_is_not_running_is_a_clear_503(tmp_path):
    host = services(tmp_path).host
    with pytest.raises(APIError) as info:
        async with host.lease("b"):
            pass
    assert (info.value.status, info.value.code) == (503, "worker_unavailable")


def test_the_measured_cost_counts_every_ready_workers_state_and_the_file_once(tmp_path):
    """spec/worker-protocol.md §3: a ready record's kv_cache_bytes, recurrent_state_bytes and
    attention_matrix_bytes (llama without flash attention: a micro-batch's attention matrix,
    written by every deep prompt chunk) are memory beside the weights, which every worker maps
    from one file. A worker that is not ready counts nothing; a bogus value counts nothing."""
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"x" * 1000)

    def worker(state: str, **fields: object) -> SimpleNamespace:
        raw = {"model": {"path": str(weights)}, **fields}
        client = SimpleNamespace(ready=SimpleNamespace(raw=raw))
        return SimpleNamespace(supervisor=SimpleNamespace(state=state), runtime=SimpleNamespace(client=client))

    workers = [worker("ready", kv_cache_bytes=100, recurrent_state_bytes=10, attention_matrix_bytes=5000),
               worker("ready", kv_cache_bytes=100, attention_matrix_bytes=True),
               worker("starting", kv_cache_bytes=10**9)]
    assert measured_cost(SimpleNamespace(pool=SimpleNamespace(workers=workers))) == 1000 + 110 + 5000 + 100
