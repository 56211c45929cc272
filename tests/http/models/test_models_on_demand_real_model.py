"""Two real models (SmolLM2-135M and Gemma 3 270M, through llama.cpp) on one port under a
memory budget that holds one of them at a time: two clients alternate between the models and
every request is answered (spec §14.5), each model loaded on demand and the idle one unloaded
least recently used first, and the measured costs (file + ready records' ``kv_cache_bytes``)
never exceed the budget together."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from testkit.worker_process import NotInstalled, gemma_path, model_path

from ..conftest import live_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]

CONTEXT, SLOTS = 1024, 1
TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"


def config(tmp_path: Path) -> str:
    try:
        paths = {"smollm2": model_path(), "gemma3": gemma_path()}
    except NotInstalled as exc:
        pytest.skip(str(exc))
    text = "".join(f'[[models]]\nid = "{model_id}"\npath = "{path}"\ncontext = {CONTEXT}\n'
                   f"slots = {SLOTS}\n" for model_id, path in paths.items())
    # The Gemma GGUF of the test extra carries no chat template.
    text += f'chat_template = "{TEMPLATES / "gemma3.jinja"}"\n'

    (tmp_path / "models.toml").write_text(text)
    return str(tmp_path / "models.toml")


def metric(text: str, name: str, **labels: str) -> float:
    for row in text.splitlines():
        if row.startswith(name + "{") and all(f'{k}="{v}"' in row for k, v in labels.items()):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


async def test_two_real_models_alternate_under_a_one_model_budget(tmp_path):
    # Gemma 3 270M's file alone is ~240 MiB and SmolLM2's ~94 MiB: 300 MiB holds either
    # model with its small KV cache, never both.
    budget = 300 << 20
    async with live_server(tmp_path, wait_ready=False, engine="llama", worker_bin="", threads=2,
                           cpu_extra_buffers="off", models_config=config(tmp_path),
                           memory_budget_bytes=budget) as srv, srv.client(timeout=300) as client:
        answers: list[tuple[str, int, str]] = []

        async def alternate(order: list[str]) -> None:
            for model in order:
                response = await client.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": "Say hello."}]})
                content = response.json()["choices"][0]["message"]["content"] \
                    if response.status_code == 200 else response.text
                answers.append((model, response.status_code, content))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(alternate, ["smollm2", "gemma3", "smollm2"])
            nursery.start_soon(alternate, ["gemma3", "smollm2", "gemma3"])
        assert [status for _, status, _ in answers] == [200] * 6, answers
        assert all(content for _, _, content in answers)
        scrape = (await client.get("/metrics")).text
        loads = {m: metric(scrape, "trioserve_model_loads_total", model=m, outcome="loaded")
                 for m in ("smollm2", "gemma3")}
        assert all(count >= 1 for count in loads.values()), loads
        assert sum(metric(scrape, "trioserve_model_unloads_total", model=m, reason="lru")
                   for m in loads) >= 1
        in_use = sum(metric(scrape, "trioserve_model_memory_bytes", model=m) for m in loads)
        assert 0 < in_use <= budget
