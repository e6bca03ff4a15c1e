"""Environments: every tool and every refusal, determinism from the seed, persistence, and scoring."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from parkway.actors.builtin.environments import ENVIRONMENTS, Bank, Counter, Letters, Workplace
from parkway.actors.sdk.environments import Environment, ToolError


def refused(env: Environment, tool: str, arguments: Any, match: str) -> None:
    before = env.export()
    with pytest.raises(ToolError, match=match):
        env.apply(tool, arguments)
    assert env.export() == before  # a refused call changes nothing


def record(env: Environment, calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict, dict]]:
    """Apply ``calls`` and return the agent's record of them."""
    return [(tool, arguments, env.apply(tool, arguments)) for tool, arguments in calls]


# -- the registry ------------------------------------------------------------------------------


def test_the_registry_names_each_environment_once() -> None:
    assert {"counter": Counter, "workplace": Workplace, "bank": Bank} == ENVIRONMENTS
    for name, cls in ENVIRONMENTS.items():
        assert cls.name == name
        names = [spec.name for spec in cls.tools]
        assert len(names) == len(set(names))
        assert not {"verify", "release"} & set(names)  # reserved by the tool server
        for spec in cls.tools:
            assert callable(getattr(cls, f"tool_{spec.name}"))


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_the_initial_state_is_a_function_of_the_seed(name: str) -> None:
    cls = ENVIRONMENTS[name]
    assert cls(7) == cls(7)
    assert cls(7).export() == cls(7).export()
    assert len({repr(cls(seed).state) for seed in range(60)}) > 1


@pytest.mark.parametrize("seed", [True, 1.0, "3", None])
def test_a_seed_must_be_an_int(seed: object) -> None:
    with pytest.raises(ValueError, match="seed must be an int"):
        Counter(seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_common_refusals(name: str) -> None:
    env = ENVIRONMENTS[name](3)
    refused(env, "frobnicate", {}, "unknown tool 'frobnicate'")
    refused(env, "verify", {}, "unknown tool 'verify'")
    first = env.tools[0]
    refused(env, first.name, ["not", "a", "dict"], "arguments must be an object")
    refused(env, first.name, {}, "missing")
    good = {"by": 1, "title": "x", "day": 1, "text": "x", "index": 1, "src": "a", "dst": "b", "amount": 1}
    arguments = {arg: good[arg] for arg, _ in first.args}
    refused(env, first.name, {**arguments, "extra": 1}, "unexpected extra")


# -- counter -----------------------------------------------------------------------------------


def test_counter_tools() -> None:
    env = Counter(23)
    assert env.apply("get", {}) == {"value": 3}
    assert env.apply("increment", {"by": 4}) == {"value": 7}
    assert env.apply("increment", {"by": 100}) == {"value": 107}
    assert env.apply("get", {}) == {"value": 107}


@pytest.mark.parametrize(
    ("by", "match"),
    [(0, "between 1 and 100"), (101, "between 1 and 100"), (-3, "between 1 and 100")]
    + [(v, "must be an integer") for v in (True, False, 2.0, "2", None, [1])],
)
def test_counter_refusals(by: object, match: str) -> None:
    refused(Counter(0), "increment", {"by": by}, match)


# -- workplace ---------------------------------------------------------------------------------


def test_workplace_tools_give_sequential_ids() -> None:
    env = Workplace(3)  # seed % 3 == 0: starts empty
    assert env.apply("list_items", {}) == {"events": [], "todos": []}
    assert env.apply("add_event", {"title": "standup", "day": 1}) == {"id": 1}
    assert env.apply("add_todo", {"text": "invoices"}) == {"id": 2}
    assert env.apply("add_event", {"title": "offsite", "day": 31}) == {"id": 3}
    assert env.apply("complete_todo", {"index": 2}) == {"id": 2, "done": True}
    listed = env.apply("list_items", {})
    assert listed == {
        "events": [{"id": 1, "title": "standup", "day": 1}, {"id": 3, "title": "offsite", "day": 31}],
        "todos": [{"id": 2, "text": "invoices", "done": True}],
    }
    listed["todos"].clear()  # the output is a copy, not the state
    assert len(env.state["todos"]) == 1


def test_workplace_seeds_its_todos() -> None:
    env = Workplace(5)  # seed % 3 == 2: two todos to start with
    assert [t["id"] for t in env.apply("list_items", {})["todos"]] == [1, 2]
    assert env.apply("add_todo", {"text": "x"}) == {"id": 3}


@pytest.mark.parametrize(
    ("tool", "arguments", "match"),
    [
        ("add_event", {"title": "x", "day": 0}, "between 1 and 31"),
        ("add_event", {"title": "x", "day": 32}, "between 1 and 31"),
        ("add_event", {"title": "x", "day": True}, "must be an integer"),
        ("add_event", {"title": "two words", "day": 3}, "must be one word"),
        ("add_event", {"title": "", "day": 3}, "must be one word"),
        ("add_event", {"title": "x" * 65, "day": 3}, "must be one word"),
        ("add_event", {"title": 5, "day": 3}, "must be one word"),
        ("add_event", {"title": "tab\there", "day": 3}, "must be one word"),
        ("add_todo", {"text": None}, "must be one word"),
        ("add_todo", {"text": "x", "day": 1}, "unexpected day"),
        ("complete_todo", {"index": 99}, "no todo with that id"),
        ("complete_todo", {"index": 0}, "no todo with that id"),
        ("complete_todo", {"index": "1"}, "must be an integer"),
        ("list_items", {"all": True}, "unexpected all"),
    ],
)
def test_workplace_refusals(tool: str, arguments: dict, match: str) -> None:
    refused(Workplace(0), tool, arguments, match)


def test_an_event_id_is_not_a_todo() -> None:
    env = Workplace(0)
    env.apply("add_event", {"title": "x", "day": 2})
    refused(env, "complete_todo", {"index": 1}, "no todo with that id")


def test_a_todo_completes_once() -> None:
    env = Workplace(0)
    env.apply("add_todo", {"text": "x"})
    env.apply("complete_todo", {"index": 1})
    refused(env, "complete_todo", {"index": 1}, "already completed")


# -- bank --------------------------------------------------------------------------------------


def test_bank_balances_come_from_the_seed() -> None:
    assert Bank(0).state == {"balances": {"a": 100, "b": 100, "c": 100}}
    assert Bank(1234).state == {"balances": {"a": 134, "b": 124, "c": 100}}
    assert Bank(7).apply("balance", {"account": "c"}) == {"account": "c", "balance": 100}


def test_bank_transfers() -> None:
    env = Bank(0)
    assert env.apply("transfer", {"src": "a", "dst": "b", "amount": 30}) == {"a": 70, "b": 130}
    assert env.apply("transfer", {"src": "b", "dst": "c", "amount": 130}) == {"b": 0, "c": 230}
    assert [env.apply("balance", {"account": x})["balance"] for x in "abc"] == [70, 0, 230]


@pytest.mark.parametrize(
    ("tool", "arguments", "match"),
    [
        ("transfer", {"src": "a", "dst": "a", "amount": 1}, "src and dst must differ"),
        ("transfer", {"src": "a", "dst": "b", "amount": 0}, "must be positive"),
        ("transfer", {"src": "a", "dst": "b", "amount": -5}, "must be positive"),
        ("transfer", {"src": "a", "dst": "b", "amount": 101}, "insufficient funds"),
        ("transfer", {"src": "a", "dst": "b", "amount": 1.5}, "must be an integer"),
        ("transfer", {"src": "d", "dst": "b", "amount": 1}, "must be one of a, b, c"),
        ("transfer", {"src": "a", "dst": 2, "amount": 1}, "must be one of a, b, c"),
        ("transfer", {"src": "a", "amount": 1}, "missing dst"),
        ("balance", {"account": "A"}, "must be one of a, b, c"),
        ("balance", {}, "missing account"),
    ],
)
def test_bank_refusals(tool: str, arguments: dict, match: str) -> None:
    refused(Bank(0), tool, arguments, match)


# -- export and restore ------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_export_and_restore_round_trip_through_the_wire(encoding: str) -> None:
    codec = msgspec.json if encoding == "json" else msgspec.msgpack
    envs = [Counter(4), Workplace(5), Bank(99)]
    record(envs[0], [("increment", {"by": 9})])
    record(envs[1], [("add_event", {"title": "x", "day": 4}), ("complete_todo", {"index": 2})])
    record(envs[2], [("transfer", {"src": "c", "dst": "a", "amount": 42})])
    for env in envs:
        data = codec.decode(codec.encode(env.export()))
        assert data == env.export()
        for restored in (Environment.restore(data), type(env).restore(data)):
            assert type(restored) is type(env) and restored == env and restored.seed == env.seed
        # The restored environment shares nothing with the one it came from.
        restored = Environment.restore(env.export())
        tool, arguments = SESSIONS[env.name][0]
        restored.apply(tool, arguments)
        assert restored != env and env.export() == data


def test_restore_refuses_what_it_cannot_trust() -> None:
    with pytest.raises(ValueError, match="cannot restore"):
        Environment.restore({"env": "casino", "seed": 1, "state": {}})
    with pytest.raises(ValueError, match="cannot restore"):
        Bank.restore(Counter(1).export())
    with pytest.raises(ValueError, match="does not have the keys"):
        Counter.restore({"env": "counter", "seed": 1, "state": {"valu": 3}})
    with pytest.raises(ValueError, match="seed must be an int"):
        Counter.restore({"env": "counter", "seed": "1", "state": {"value": 3}})


# -- verify ------------------------------------------------------------------------------------


SESSIONS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "counter": [("increment", {"by": 3}), ("get", {}), ("increment", {"by": 5})],
    "workplace": [
        ("add_todo", {"text": "x"}),
        ("add_event", {"title": "y", "day": 9}),
        ("list_items", {}),
        ("complete_todo", {"index": 1}),
    ],
    "bank": [
        ("transfer", {"src": "a", "dst": "b", "amount": 10}),
        ("balance", {"account": "b"}),
        ("transfer", {"src": "b", "dst": "c", "amount": 5}),
    ],
}


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_an_honest_record_scores_one(name: str) -> None:
    env = ENVIRONMENTS[name](3)
    calls = record(env, SESSIONS[name])
    assert env.verify(calls) == 1.0
    assert env.verify([c for c in calls if env.spec(c[0]).mutates]) == 1.0  # reads do not matter
    assert ENVIRONMENTS[name](3).verify([]) == 1.0  # nothing done, nothing to find


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_a_mutation_applied_twice_scores_zero(name: str) -> None:
    env = ENVIRONMENTS[name](3)
    calls = record(env, SESSIONS[name])
    tool, arguments, _ = calls[0]
    env.apply(tool, arguments)  # a redelivered call that ran again
    assert env.verify(calls) == 0.0


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_a_lost_mutation_scores_zero(name: str) -> None:
    env = ENVIRONMENTS[name](3)
    calls = record(env, SESSIONS[name])
    lost = ENVIRONMENTS[name](3)
    record(lost, SESSIONS[name][:-1])  # the last call's effect was lost in a crash, the agent kept it
    assert lost.state != env.state
    assert lost.verify(calls) == 0.0
    assert env.verify(calls[:-1]) == 0.0  # or the agent lost the record of a call that was applied


def test_a_bank_transfer_twice_shows_in_the_balances() -> None:
    env = Bank(0)
    calls = record(env, [("transfer", {"src": "a", "dst": "b", "amount": 10})])
    env.apply("transfer", {"src": "a", "dst": "b", "amount": 10})
    assert env.state["balances"] == {"a": 80, "b": 120, "c": 100}
    assert env.verify(calls) == 0.0


def test_a_record_that_does_not_replay_scores_zero() -> None:
    env = Bank(0)
    assert env.verify([("transfer", {"src": "a", "dst": "b", "amount": 1000}, {})]) == 0.0
    assert env.verify([("transfer", {"src": "a", "dst": "a", "amount": 1}, {})]) == 0.0


@pytest.mark.parametrize(
    ("calls", "match"),
    [
        ({"not": "a list"}, "must be a list"),
        ([("get", {})], "is not \\(tool, arguments, output\\)"),
        ([("get", {}, {}, {})], "is not \\(tool, arguments, output\\)"),
        ([(1, {}, {})], "is not \\(tool, arguments, output\\)"),
        ([("get", [], {})], "is not \\(tool, arguments, output\\)"),
        ([("get", {}, "out")], "is not \\(tool, arguments, output\\)"),
        ([("teleport", {}, {})], "unknown tool 'teleport'"),
    ],
)
def test_a_malformed_record_is_a_tool_error(calls: Any, match: str) -> None:
    with pytest.raises(ToolError, match=match):
        Counter(0).verify(calls)


# -- properties --------------------------------------------------------------------------------

values = st.one_of(
    st.integers(-2, 40),
    st.sampled_from(["a", "b", "c", "word"]),
    st.sampled_from([True, None, 2.0, "two words", "", "d", [1], 10**30]),
)
arg_names = st.sampled_from(["by", "title", "day", "text", "index", "src", "dst", "amount", "account", "zz"])


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(ENVIRONMENTS)), seed=st.integers(-(10**6), 10**6), data=st.data())
def test_any_input_is_an_output_or_a_tool_error(name: str, seed: int, data: st.DataObject) -> None:
    env = ENVIRONMENTS[name](seed)
    honest = []
    for _ in range(data.draw(st.integers(0, 25))):
        spec = data.draw(st.sampled_from(env.tools))
        tool, arguments = spec.name, {arg: data.draw(values) for arg, _ in spec.args}
        if data.draw(st.integers(0, 9)) == 0:  # now and then, something that is not even close
            tool = data.draw(st.sampled_from([tool, "x", ""]))
            arguments = data.draw(st.dictionaries(arg_names, values, max_size=4))
        try:
            output = env.apply(tool, arguments)
        except ToolError as err:
            assert err.message
            continue
        assert isinstance(output, dict)
        honest.append((tool, arguments, output))
    assert env.verify(honest) == 1.0
    assert Environment.restore(msgspec.json.decode(msgspec.json.encode(env.export()))) == env


def test_letters_scores_the_fraction_of_the_target_letter_in_what_was_submitted() -> None:
    env = Letters(0)
    assert env.apply("submit", {"text": "banana"}) == {"length": 6}
    record = [("submit", {"text": "banana"}, {"length": 6})]
    assert env.verify(record) == 0.5  # three a's in six characters
    assert env.verify([("submit", {"text": "aaaa"}, {"length": 4})]) == 0.0  # not what it holds
    assert Letters(1).verify([]) == 0.0  # nothing submitted
    with pytest.raises(ToolError, match="one word"):
        env.apply("submit", {"text": "two words"})
    assert Letters.restore(env.export()) == env
