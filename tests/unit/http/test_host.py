"""The simple model host (trioserve/http/host.py): leases count requests on their model and
give them back however the block ends; state follows the model's pool."""

from __future__ import annotations

import pytest

from trioserve.config import Settings
from trioserve.http.services import build_services


def services(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text("[[models]]\nid = 'a'\nengine = 'fake'\n[[models]]\nid = 'b'\nengine = 'fake'\n")
    return build_services(Settings(models_config=str(config), worker_bin="/w"))


async def test_a_lease_counts_its_request_until_the_block_ends(tmp_path):
    host = services(tmp_path).host
    async with host.lease("b") as model:
        assert model.model_id == "b" and model.active == 1
        assert host.services("a").active == 0
        release = model.hold()  # a stream extends the count past the handler
        release()
        release()  # idempotent
        assert model.active == 1
    assert model.active == 0
    with pytest.raises(RuntimeError):
        async with host.lease("a") as failing:
            raise RuntimeError("the handler failed")
    assert failing.active == 0


def test_not_started_models_are_not_loaded_and_each_has_its_own_pool(tmp_path):
    built = services(tmp_path)
    host = built.host
    assert [m.model_id for m in host.loaded()] == ["a", "b"]
    assert host.services("a").pool is not host.services("b").pool
    assert host.state("a") == "loading"  # a supervisor not yet run reports loading
    assert built.model_id == "a" and built.pool is host.services("a").pool  # the default
    assert host.services("b").core.names.serves("b", "chat")
    assert not host.services("b").core.names.serves("a", "chat")
