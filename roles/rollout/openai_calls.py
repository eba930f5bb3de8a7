"""`/v1/chat/completions` and `/v1/completions` bodies against one agent episode, with vLLM's
own request and response models (so validation errors and the reply's shape are vLLM's).

What a caller may rely on:
* `chat` / `complete` validate the body (a one-line `CallRefused` otherwise), build the
  call's prompt ids, sample through the episode (roles/rollout/agent_episode.py) and
  return the reply as a JSON-ready dict. Each choice carries `token_ids`, the ids exactly
  as sampled (vLLM's agent-tracing field), and the reply `prompt_token_ids`, the context
  the model was given.
* The first chat call renders the messages as vLLM's server does (roles/rollout/chat_render.py).
  A later call whose messages are the previous call's messages plus the reply as returned
  plus new ones keeps the earlier turns as sampled and renders only what is new; any other
  call is rendered whole (a new segment, if its ids do not continue the episode).
* Sampling is the run's (`rollout.temperature`, `top_p`, `top_k`: the behaviour policy the
  trainer assumes); a request's `max_tokens` / `max_completion_tokens` lowers
  `rollout.max_tokens`, its `stop` strings cut the reply after the token that completes
  one. `n` > 1 and `stream` are refused.
* A request's grammar is vLLM's: `tool_choice` "required" or a named function (a tool-call
  grammar from the tool parser, and the call parsed as vLLM's server parses it),
  `response_format` or `structured_outputs`; the reply is sampled under it by the rollout's
  engine, and its recorded logprobs are those of the constrained distribution.
"""

from __future__ import annotations

import json
from typing import Any

from roles.generation.engine import Sample
from roles.rollout.agent_episode import AgentEpisode, CallRefused, ChatTurn
from roles.rollout.chat_render import ChatRenderer
from transport.wire import FinishReason

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


def _validated(cls: Any, body: dict[str, Any]) -> Any:
    from pydantic import ValidationError
    from vllm.exceptions import VLLMClientError

    try:
        request = cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise CallRefused(f"invalid request: {where}: {first.get('msg', 'invalid')}") from None
    except VLLMClientError as exc:  # vLLM's validators raise their own, past pydantic's wrapping
        raise CallRefused(f"invalid request: {exc}") from None
    if (request.n or 1) != 1:
        raise CallRefused("n must be 1: each call is one step of the episode")
    if request.stream:
        raise CallRefused("stream=true is not served; ask without streaming")
    return request


async def chat(ep: AgentEpisode, renderer: ChatRenderer, body: dict[str, Any], model: str) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = _adjusted(renderer, _validated(ChatCompletionRequest, body))
    messages = [_plain(m) for m in body.get("messages") or []]
    if not messages:
        raise CallRefused("invalid request: messages: at least one message is needed")
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    kwargs = dict(request.chat_template_kwargs or {})
    async with ep.lock:
        ids = _chat_prompt(ep, renderer, messages, tools, kwargs)
        s = await ep.generate(ids, _max_tokens(request, ep.max_tokens), request.extract_structured_outputs())
        sampled, text = _cut(renderer, s, request.stop)
        raw = renderer.decode(sampled, skip_special_tokens=False)
        content, calls = renderer.parse_reply(_visible(renderer, sampled, s, request), request)
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
        ep.last_chat = ChatTurn([*messages, _plain(reply)], tools, raw)
    return _chat_response(model, reply, _chat_finish(request, calls, s, text), ids, sampled)


def _adjusted(renderer: ChatRenderer, request: Any) -> Any:
    """The request as vLLM's server samples it: a forced tool call's grammar, the tool
    parser's settings (roles/rollout/chat_render.py)."""
    from vllm.exceptions import VLLMClientError

    try:
        return renderer.adjust(request)
    except (ValueError, VLLMClientError) as exc:
        raise CallRefused(f"invalid request: {exc}") from None


def _chat_prompt(
    ep: AgentEpisode, renderer: ChatRenderer, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]
) -> list[int]:
    last = ep.last_chat
    continues = last is not None and len(messages) > len(last.messages) and last.tools == tools
    if last is not None and continues and _keys(messages[: len(last.messages)]) == _keys(last.messages):
        text = renderer.continuation(last.messages, messages, tools, last.completion_text, kwargs)
        if text is not None:
            return ep.context() + renderer.encode(text)
    return renderer.encode(renderer.render(messages, tools, kwargs=kwargs))


async def complete(ep: AgentEpisode, renderer: ChatRenderer, body: dict[str, Any], model: str) -> dict:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = _validated(CompletionRequest, body)
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    async with ep.lock:
        if isinstance(prompt, str):
            last = ep.last_text
            tail = prompt[len(last) :] if last is not None and prompt.startswith(last) else None
            ids = ep.context() + renderer.encode(tail) if tail is not None else renderer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise CallRefused("invalid request: prompt: one text or one list of token ids")
        s = await ep.generate(ids, _max_tokens(request, ep.max_tokens), request.extract_structured_outputs())
        sampled, text = _cut(renderer, s, request.stop)
        ep.last_text = renderer.decode(ids + sampled, skip_special_tokens=False) if isinstance(prompt, str) else None
    choice = {"index": 0, "text": text, "finish_reason": _finish(s, text), "token_ids": sampled}
    return {
        "id": f"cmpl-{ep.episode_id}-{ep.calls}",
        "object": "text_completion",
        "model": model,
        "choices": [choice],
        "usage": _usage(ids, sampled),
        "prompt_token_ids": ids,
    }


def _max_tokens(request: Any, cap: int) -> int:
    asked = getattr(request, "max_completion_tokens", None) or request.__dict__.get("max_tokens")
    return min(cap, asked) if asked else cap


def _cut(renderer: ChatRenderer, s: Sample, stop: Any) -> tuple[list[int], str]:
    """The sampled ids up to the token that completes a stop string, and the text before it."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    ids = list(s.token_ids)
    if stops:
        for i in range(len(ids)):
            text = renderer.decode(ids[: i + 1], skip_special_tokens=True)
            hit = min((text.index(x) for x in stops if x and x in text), default=-1)
            if hit >= 0:
                s.finish_reason = FinishReason.STOP
                return ids[: i + 1], text[:hit]
    return ids, renderer.decode(ids, skip_special_tokens=True)


def _visible(renderer: ChatRenderer, ids: list[int], s: Sample, request: Any) -> str:
    """The reply text vLLM's chat server parses: the stop token left out, special tokens
    as the adjusted request says (a tool parser keeps them: call markers may be special)."""
    special = set(getattr(renderer.tokenizer, "all_special_ids", []) or [])
    if s.finish_reason == FinishReason.STOP and ids and ids[-1] in special:
        ids = ids[:-1]
    return renderer.decode(ids, skip_special_tokens=request.skip_special_tokens)


def _finish(s: Sample, text: str) -> str:
    return _FINISH.get(s.finish_reason, "stop")


def _chat_finish(request: Any, calls: list[dict[str, Any]], s: Sample, text: str) -> str:
    """vLLM's finish reason: "tool_calls" for calls under tool_choice "auto", and for a
    reply under "required" that ended as its grammar allows; a named call ends "stop"."""
    auto_called = bool(calls) and request.tool_choice == "auto"
    if auto_called or (request.tool_choice == "required" and s.finish_reason == FinishReason.STOP):
        return "tool_calls"
    return _finish(s, text)


def _usage(prompt: list[int], sampled: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(sampled), "total_tokens": len(prompt) + len(sampled)}


def _chat_response(model: str, reply: dict[str, Any], finish: str, ids: list[int], sampled: list[int]) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    message = ChatMessage.model_validate(reply)
    choice = ChatCompletionResponseChoice(index=0, message=message, finish_reason=finish, token_ids=sampled)
    response = ChatCompletionResponse(
        model=model, choices=[choice], usage=UsageInfo.model_validate(_usage(ids, sampled)), prompt_token_ids=ids
    )
    return response.model_dump(mode="json", exclude_none=True)  # type: ignore[no-any-return]


def _plain(message: Any) -> dict[str, Any]:
    """A message as a plain dict (the request's JSON), without keys that are None."""
    if not isinstance(message, dict):
        raise CallRefused("invalid request: messages: each message must be an object")
    return {k: v for k, v in message.items() if v is not None}


def _keys(messages: list[dict[str, Any]]) -> list[str]:
    return [_key(m) for m in messages]


def _key(message: dict[str, Any]) -> str:
    """What makes two messages the same turn: role, text, tool calls (arguments as JSON
    values), tool call id; the SDK's extra empty fields do not count."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        calls.append([fn.get("name"), args])
    return json.dumps([message.get("role"), content or "", calls, message.get("tool_call_id")], sort_keys=True)
