"""Session branches and the divergence report as pure bookkeeping (core/branches.py)."""

from __future__ import annotations

from typing import Any

import pytest

from trioserve.core.branches import BRANCH_SEPARATOR, BranchTable, divergence, shape_of
from trioserve.core.sessions import SessionKey
from trioserve.worker import routing

SYSTEM = "You are an agent.\nToday is 2026-12-06.\nBe brief."
TOOLS = [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]


def conv(*turns: str, system: str = SYSTEM) -> list[dict[str, Any]]:
    """A conversation: system, then user/assistant turns alternating."""
    out = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        out.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return out


def shape(*turns: str, tools: Any = TOOLS, **kw: Any):
    return shape_of(conv(*turns, **kw), tools)


KEY = SessionKey("s1", "prompt_cache_key")


def test_the_next_turn_continues_the_branch_and_a_sub_agent_opens_its_own():
    table = BranchTable(max_branches=4)
    main1 = table.place(KEY, shape("task"))
    assert (main1.name, main1.opened, main1.divergence) == ("s1", True, None)
    sub = table.place(KEY, shape("sub-agent task"))
    assert sub.opened and sub.name == "s1" + BRANCH_SEPARATOR + "#2"
    assert sub.divergence is not None and sub.divergence.message_index == 1
    assert sub.divergence.change == "text" and sub.source == "#1"
    # The main conversation's next turn extends the main branch (not the newer sub-agent's).
    main2 = table.place(KEY, shape("task", "answer", "more"))
    assert (main2.name, main2.opened, main2.divergence) == ("s1", False, None)
    # The sub-agent's next turn extends its own branch.
    sub2 = table.place(KEY, shape("sub-agent task", "done", "next"))
    assert (sub2.name, sub2.opened) == (sub.name, False)
    assert table.opened == 1 and table.branch_count() == 2


def test_a_request_that_is_a_prefix_of_the_branch_opens_a_branch_reporting_removed():
    table = BranchTable()
    table.place(KEY, shape("task", "answer", "more"))
    title = table.place(KEY, shape("task"))
    assert title.opened and title.divergence is not None
    assert (title.divergence.message_index, title.divergence.change) == (2, "removed")


def test_agent_ids_name_branches_and_keep_them_apart():
    table = BranchTable()
    main = table.place(SessionKey("s1", "h", agent="main-agent"), shape("task"))
    sub = table.place(SessionKey("s1", "h", agent="agent-7"), shape("task"))
    assert main.name == "s1" and main.label == "main-agent"
    # Same prompt, another agent: its own branch all the same.
    assert sub.opened and sub.name == "s1" + BRANCH_SEPARATOR + "agent-7"
    again = table.place(SessionKey("s1", "h", agent="agent-7"), shape("other"))
    assert not again.opened and again.divergence is not None and again.divergence.branch == "agent-7"


def test_the_bound_evicts_the_least_recently_used_branch_never_the_copy_source():
    table = BranchTable(max_branches=2)
    table.place(KEY, shape("main"))
    sub_a = table.place(KEY, shape("sub a"))
    table.place(KEY, shape("main", "x", "y"))  # main used last
    sub_b = table.place(KEY, shape("main", "x", "z"))  # nearest: main (3 messages shared)
    assert sub_b.source == "#1"
    order = table.eviction_order(sub_b)
    assert order == [sub_a.name]
    table.evicted(KEY.key, sub_a.name)
    assert table.evictions == 1 and table.branch_count() == 2 and not table.over_bound(KEY.key)
    # sub a comes back: its branch is gone, so it opens a new one.
    assert table.place(KEY, shape("sub a", "r", "s")).opened


def test_one_branch_means_branching_off():
    table = BranchTable(max_branches=1)
    table.place(KEY, shape("main"))
    sub = table.place(KEY, shape("sub"))
    assert (sub.name, sub.opened) == ("s1", False)
    assert sub.divergence is not None and sub.divergence.change == "text"


def test_divergence_names_what_changed():
    held = shape("a", "b", "c")
    assert divergence(shape("a", "b", "c", "d", "e"), held, "#1") is None
    assert divergence(shape("a", "b", "c", tools=None), held, "#1").change == "tools"  # type: ignore[union-attr]
    edited = divergence(shape("a", "B", "c", "d", "e"), held, "#1")
    assert edited is not None and (edited.message_index, edited.change) == (2, "text")
    dated = divergence(shape("a", "b", "c", system=SYSTEM.replace("06", "07")), held, "#1")
    assert dated is not None and (dated.message_index, dated.change, dated.line) == (0, "system_line", 1)
    assert dated.log_text() == "msg0:system_line1"
    role = shape_of([*conv("a"), {"role": "user", "content": "b"}], TOOLS)
    found = divergence(role, held, "#1")
    assert found is not None and (found.message_index, found.change) == (2, "role")
    assert divergence(shape_of(conv("a", "b", "c"), TOOLS, options=["high"]), held, "#1").change == "options"  # type: ignore[union-attr]


def test_keys_are_bounded_and_forget_returns_every_branch_name():
    table = BranchTable(max_keys=2)
    for key in ("k1", "k2", "k3"):
        table.place(SessionKey(key, "p"), shape("x"))
    table.place(SessionKey("k3", "p"), shape("y"))
    assert table.names("k1") == ["k1"]  # forgotten: only the key's own name
    assert table.forget("k3") == ["k3", "k3" + BRANCH_SEPARATOR + "#2"]
    assert table.branch_count() == 1


def test_every_branch_of_a_key_routes_like_the_key():
    assert routing.BRANCH_SEPARATOR == BRANCH_SEPARATOR
    name = "conv-1" + BRANCH_SEPARATOR + "#3"
    assert routing.routing_key(name) == "conv-1"
    assert routing.key_order(routing.routing_key(name), 5) == routing.key_order("conv-1", 5)


def test_bounds_must_be_positive():
    with pytest.raises(ValueError):
        BranchTable(max_branches=0)
