"""Black-box agents (``actors/builtin/blackbox``): the OpenAI format, and whole runs of a program that
knows nothing of parkway (``examples/openai-agent/agent.py``) on the in-memory broker: it finishes its
rollouts through the gateway, and after a crash a program that is not deterministic given its inputs is
caught diverging from its recorded history and redone from its prompt, never answered from a record of
another request. (The crash over RabbitMQ with real signals: tests/integration/test_blackbox_crash.py.)
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from parkway.actors.builtin.blackbox import openai_format
from parkway.actors.builtin.blackbox.openai_format import FormatError
from parkway.actors.runtime.packs import read_records
from parkway.actors.sdk import chat
from parkway.protocol.transcript import SavedRollout

from tests.support.embedded import embedded_run

AGENT = Path(__file__).resolve().parents[3] / "examples" / "openai-agent" / "agent.py"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "transfer",
            "parameters": {
                "type": "object",
                "properties": {"src": {"type": "string", "enum": ["a", "b"]}, "amount": {"type": "integer"}},
            },
        },
    }
]


def test_a_request_becomes_the_conversation_the_model_reads() -> None:
    body = {
        "model": "x",
        "messages": [
            {"role": "system", "content": "task: move money"},
            {"role": "user", "content": [{"type": "text", "text": "Move "}, {"type": "text", "text": "it."}]},
            {
                "role": "assistant",
                "content": "ok",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "transfer", "arguments": '{"amount": 3}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": '{"ok": true}'},
        ],
        "tools": TOOLS,
    }
    messages = openai_format.conversation(body, max_turns=4)
    assert messages[0] == chat.Message(
        "system", "task: move money\ntools: transfer(src:choice:a|b,amount:int)\nturns: 4"
    )
    assert messages[1] == chat.Message("user", "Move it.")
    assert messages[2].content == 'ok<tool>{"name": "transfer", "arguments": {"amount": 3}}</tool>'
    assert openai_format.conversation(body, max_turns=4) == messages  # a pure function: replays match
    assert openai_format.tool_specs(
        openai_format.openai_tools(openai_format.tool_specs(TOOLS))
    ) == openai_format.tool_specs(TOOLS)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "the body must be a JSON object"),
        ({"messages": []}, "messages: must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]: want an object with a role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n: only 1"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "t", "arguments": "{"}}]}
                ]
            },
            "arguments are not JSON",
        ),
    ],
)
def test_bad_requests_are_typed_errors(body: object, message: str) -> None:
    with pytest.raises(FormatError, match=message.replace("[", r"\[").replace("]", r"\]")):
        openai_format.conversation(body, max_turns=3)


def test_a_reply_becomes_a_completion_and_its_stream() -> None:
    text = 'let me see <tool>{"name": "transfer", "arguments": {"amount": 2}}</tool>'
    done = openai_format.completion(
        text, finish_reason="stop", call_id="chatcmpl-1", model="m", prompt_tokens=10, completion_tokens=5
    )
    [choice] = done["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "let me see"
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "transfer", "arguments": '{"amount": 2}'}
    assert done["usage"]["total_tokens"] == 15
    chunks = openai_format.stream_chunks(done)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[1]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    answer = openai_format.completion(
        "<answer>7</answer>",
        finish_reason="stop",
        call_id="c",
        model="m",
        prompt_tokens=1,
        completion_tokens=1,
    )
    assert (
        answer["choices"][0]["finish_reason"] == "stop"
        and "tool_calls" not in answer["choices"][0]["message"]
    )


def workload(argv: list[str], *, stream: bool = False, tools: str = "http") -> dict[str, object]:
    return {
        "run": "bbox",
        "seed": 4,
        "agent": "command",
        "command": {"argv": argv, "env": {"AGENT_STREAM": "1" if stream else "0", "AGENT_TOOLS": tools}},
        "rollout": {"group_size": 2, "max_turns": 4},
        "tasks": {"builtin": "bank", "limit": 2},
        "policy": {"host": "inline", "per_token_delay_s": 0.002},
        "trainer": {"batch_groups": 1},
        "snapshot_interval_s": 0.2,
    }


@pytest.mark.slow  # a program per attempt
@pytest.mark.parametrize(
    ("stream", "tools"), [(False, "http"), (True, "http"), (False, "mcp")], ids=["plain", "stream", "mcp"]
)
async def test_a_program_that_knows_nothing_of_parkway_runs_its_rollouts(
    tmp_path: Path, stream: bool, tools: str
) -> None:
    pytest.importorskip("openai")
    if tools == "mcp":
        pytest.importorskip("mcp")
    data = workload([sys.executable, str(AGENT)], stream=stream, tools=tools)
    summary = await embedded_run(data, tmp_path)
    assert summary.rollouts_sealed == 4 and summary.rollouts_failed == 0 and summary.mean_reward == 1.0
    assert summary.tool_calls > 0  # the bank's transfers went through the tools route under test
    assert (
        summary.model_calls >= 4 and summary.tool_mutations_duplicated == 0 and summary.sessions_leaked == 0
    )


NOT_DETERMINISTIC = textwrap.dedent(
    """
    import json, os, random, sys, urllib.request
    from openai import OpenAI
    client = OpenAI()
    # A program whose first request depends on something other than its inputs.
    note = f"{os.environ['PARKWAY_PROMPT']} (note {random.random()})"
    messages = [{"role": "user", "content": note}]
    tools = json.loads(os.environ["PARKWAY_TOOLS"])
    for _ in range(int(os.environ["PARKWAY_MAX_TURNS"])):
        message = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
        calls = [c.model_dump() for c in message.tool_calls or ()]
        messages.append({"role": "assistant", "content": message.content or "", "tool_calls": calls or None})
        if not calls:
            break
        for call in calls:
            request = urllib.request.Request(
                os.environ["PARKWAY_TOOLS_URL"] + "/" + call["function"]["name"],
                data=call["function"]["arguments"].encode(), headers={"Content-Type": "application/json"},
            )
            result = urllib.request.urlopen(request).read().decode()
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    """
)


@pytest.mark.slow  # a program per attempt
async def test_a_program_that_diverges_from_its_record_is_redone_from_its_prompt(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    from parkway.actors.roles.controller.controller import SimulatedCrash

    script = tmp_path / "agent.py"
    script.write_text(NOT_DETERMINISTIC)
    data = workload([sys.executable, str(script)])
    data["rollout"] = {"group_size": 2, "max_turns": 4, "max_attempts": 3}
    state = tmp_path / "state"
    with pytest.raises(SimulatedCrash):
        await embedded_run(data, state, stop_after=3)
    snapshot = sorted((state / "snapshots" / "bbox").glob("snapshot_*"))[-1]
    saved = [
        rollout
        for path in snapshot.glob("participants/agent/*/rollouts.msgpack")
        for rollout in read_records(path, SavedRollout)
    ]
    with_history = [r for r in saved if r.model]
    assert with_history, "the snapshot must hold finished model calls, or this case proves nothing"
    summary = await embedded_run(data, state)
    # Each restored program with a recorded model call asked another first call than the recorded one:
    # refused, never answered from the record, and the rollout redone from its prompt (live: no record).
    assert summary.rollouts_restored == len(saved)
    assert summary.attempts_failed_by_code == {"replay_diverged": len(with_history)}
    assert summary.rollouts_sealed == 4 and summary.rollouts_failed == 0
    assert summary.tool_mutations_duplicated == 0 and summary.sessions_leaked == 0


ENV_DUMP = textwrap.dedent(
    """
    import json, os, sys
    with open(sys.argv[1], "a") as out:
        out.write(json.dumps(sorted(k for k in os.environ if k.startswith("PARKWAY_"))) + "\\n")
    os.execv(sys.executable, [sys.executable, sys.argv[2]])  # then the example agent, as it is
    """
)


@pytest.mark.slow  # a program per attempt
async def test_the_program_gets_the_rollout_not_the_agents_keys(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("openai")
    monkeypatch.setenv("PARKWAY_SECRET_FOR_TEST", "the agent's, not the program's")
    script, dump = tmp_path / "dump.py", tmp_path / "env.jsonl"
    script.write_text(ENV_DUMP)
    summary = await embedded_run(
        workload([sys.executable, str(script), str(dump), str(AGENT)]), tmp_path / "state"
    )
    assert summary.rollouts_sealed == 4 and summary.mean_reward == 1.0
    seen = {tuple(json.loads(line)) for line in dump.read_text().splitlines()}
    assert seen == {
        (
            "PARKWAY_ATTEMPT",
            "PARKWAY_MAX_TURNS",
            "PARKWAY_MCP_URL",
            "PARKWAY_PROMPT",
            "PARKWAY_ROLLOUT_ID",
            "PARKWAY_TOOLS",
            "PARKWAY_TOOLS_URL",
        )
    }
