"""The rollout's OpenAI-compatible endpoint: agents that own their loop call it as they would
call `vllm serve`, and every call lands, token-exact, in the episode it names.

Routes (the episode id is in the path, so `base_url` alone routes an SDK's calls):

    POST /episodes/{id}/v1/chat/completions     POST /episodes/{id}/v1/completions
    GET  /episodes/{id}/v1/models               POST /episodes/{id}/reward   {"reward": 0.5}
    POST /v1/chat/completions, /v1/completions  (the episode in header `X-Tandem-Episode`)

What a caller may rely on:
* Every request must carry `Authorization: Bearer <key>`, the run's endpoint key
  (`endpoint_key`: an HMAC of the run token, so the key an agent holds is not the token
  that admits a process to the run's sockets). A request without it gets 401 and is
  counted and logged (the first 3, then at the 10th, 100th, ...), before its body is read.
* The server binds `transport.bind_host` (127.0.0.1 unless the config says otherwise), on
  `rollout.openai.port` + the rollout's rank, or a free port when that is 0.
* Any fault of a request (malformed JSON, a body vLLM's models refuse, an unknown or
  finished episode, an over-budget call) is one JSON error line with a 4xx status; a fault
  of the server's own is a 500 with one line; the rollout goes on either way.
* Sizes and times are bounded (`Limits`, from `rollout.openai`). A body must say its
  length (a chunked one gets 411) and is taken as sent (a compressed one is not
  inflated, so it is not JSON); one over `max_request_bytes` is refused with 413 before
  it is read, one over `max_model_len` x `MAX_BYTES_PER_TOKEN` with 400 before it is
  parsed or tokenized (it could not fit the context); so what a request holds in memory
  is bounded by the cap. A body not received within `body_timeout_s` gets 408; a
  connection that has not sent a request's headers within `header_timeout_s` (or idles
  that long between requests) is closed (roles/rollout/http_guard.py), counted and
  logged (`endpoint_slow_client`, the first 3, then at the 10th, 100th, ...). `NaN` and
  `Infinity` are not JSON: a body holding them is refused as malformed, and `/reward`
  takes finite numbers only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roles.rollout import openai_calls
from roles.rollout.agent_episode import AgentEpisode, CallRefused
from roles.rollout.chat_render import ChatRenderer
from roles.rollout.http_guard import ConnectionGuard
from runtime.errors import one_line
from runtime.identity.run_token import read_token
from runtime.logs import get_logger

log = get_logger("rollout")
EPISODE_HEADER = "X-Tandem-Episode"
MAX_BYTES_PER_TOKEN = 32  # a body longer than the context x this cannot be a prompt that fits


@dataclass(frozen=True)
class Limits:
    """The endpoint's bounds (`rollout.openai.*`)."""

    max_request_bytes: int = 2**20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0


def endpoint_key(run_dir: str | Path) -> str:
    """The key agents present to this run's endpoints (derived from the run token)."""
    return hmac.new(read_token(run_dir).encode(), b"tandem-openai-endpoint", hashlib.sha256).hexdigest()


class EndpointServer:
    def __init__(
        self, renderer: ChatRenderer, key: str, *, model: str, max_model_len: int, limits: Limits | None = None
    ) -> None:
        self.renderer = renderer
        self.limits = limits or Limits()
        self.guard = ConnectionGuard(self.limits.header_timeout_s, on_slow=self._slow_client)
        self.key = key
        self.model = model
        self.max_model_len = max_model_len
        self.episodes: dict[str, AgentEpisode] = {}
        self.refused = 0
        self.failed = 0
        self.base_url = ""
        self._runner: Any = None
        self._server: Any = None

    def _slow_client(self, count: int) -> None:
        if count <= 3 or _power_of_ten(count):
            log.warning("endpoint_slow_client", header_timeout_s=self.limits.header_timeout_s, closed=count)

    def body_cap(self) -> int:
        """The most bytes a request body may have."""
        return min(self.limits.max_request_bytes, self.max_model_len * MAX_BYTES_PER_TOKEN + 64 * 1024)

    async def start(self, host: str, port: int) -> str:
        """Serve; returns the base address (`http://HOST:PORT`)."""
        from aiohttp import web

        @web.middleware
        async def guard(request: Any, handler: Any) -> Any:
            return await self._guard(request, handler)

        app = web.Application(client_max_size=self.body_cap(), middlewares=[guard])
        for prefix in ("/episodes/{episode}/v1", "/v1"):
            app.router.add_post(f"{prefix}/chat/completions", self._call(openai_calls.chat))
            app.router.add_post(f"{prefix}/completions", self._call(openai_calls.complete))
            app.router.add_get(f"{prefix}/models", self._models)
        app.router.add_post("/episodes/{episode}/reward", self._reward)
        # lingering_time=0: a refused body is not read to its end; auto_decompress=False: a
        # compressed body is taken as sent (so its size is the size the cap judged), not inflated
        self._runner = web.AppRunner(app, access_log=None, lingering_time=0, auto_decompress=False, read_bufsize=2**14)
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self.guard.factory(self._runner.server), host, port)
        bound = self._server.sockets[0].getsockname()
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{shown}:{bound[1]}"
        return self.base_url

    async def close(self) -> None:
        self.guard.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def episode_url(self, episode_id: str) -> str:
        return f"{self.base_url}/episodes/{episode_id}"

    # --- HTTP ------------------------------------------------------------------------------
    async def _guard(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        from aiohttp import web

        presented = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(presented.encode(), self.key.encode()):
            self.refused += 1
            if self.refused <= 3 or _power_of_ten(self.refused):
                log.warning("endpoint_refused", path=request.path, peer=request.remote, refused=self.refused)
            return _error(401, "missing or wrong API key: use the run's endpoint key", "authentication_error")
        try:
            with self.guard.busy(request.transport):
                return await handler(request)
        except web.HTTPException as exc:
            return _error(exc.status, exc.reason or "bad request")
        except Exception as exc:  # the server's own fault: one line, the rollout goes on
            self.failed += 1
            if self.failed <= 3 or _power_of_ten(self.failed):
                log.warning("endpoint_failed", path=request.path, error=one_line(exc, 300), failed=self.failed)
            return _error(500, f"internal error: {one_line(exc, 300)}", "server_error")

    def _call(self, fn: Any) -> Callable[[Any], Awaitable[Any]]:
        async def handle(request: Any) -> Any:
            ep = self._episode(request)
            body = await self._json(request)
            try:
                reply = await fn(ep, self.renderer, body, self.model)
            except CallRefused as exc:
                return _error(400, str(exc))
            return _ok(reply)

        return handle

    async def _models(self, request: Any) -> Any:
        card = {"id": self.model, "object": "model", "owned_by": "tandem", "max_model_len": self.max_model_len}
        return _ok({"object": "list", "data": [card]})

    async def _reward(self, request: Any) -> Any:
        ep = self._episode(request)
        body = await self._json(request)
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            return _error(400, "invalid request: reward: a finite number is needed")
        ep.report(float(reward))
        return _ok({"episode": ep.episode_id, "reward": ep.reward})

    def _episode(self, request: Any) -> AgentEpisode:
        from aiohttp import web

        episode_id = request.match_info.get("episode") or request.headers.get(EPISODE_HEADER, "")
        if not episode_id:
            raise web.HTTPBadRequest(reason=f"no episode: call base_url .../episodes/ID/v1 or set {EPISODE_HEADER}")
        ep = self.episodes.get(episode_id)
        if ep is None:
            raise web.HTTPNotFound(reason=f"episode {episode_id[:64]} is not open here")
        return ep

    async def _json(self, request: Any) -> dict[str, Any]:
        """The request's body as a JSON object, its size and time bounded (see the module docs)."""
        from aiohttp import web

        cap, fits = self.body_cap(), self.max_model_len * MAX_BYTES_PER_TOKEN + 64 * 1024
        if request.content_length is None and request.body_exists:
            raise web.HTTPLengthRequired(reason="a request body must say its Content-Length (chunked is not taken)")
        if request.content_length is not None and request.content_length > self.limits.max_request_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=cap, actual_size=request.content_length)
        if request.content_length is not None and request.content_length > fits:
            raise web.HTTPBadRequest(
                reason=f"invalid request: a body of {request.content_length} bytes cannot fit the context of "
                f"{self.max_model_len} tokens (rollout.engine.max_model_len)"
            )
        try:
            raw = await asyncio.wait_for(request.read(), self.limits.body_timeout_s)
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()  # the rest of the body is not worth waiting for
            raise web.HTTPRequestTimeout(
                reason=f"the body did not arrive in {self.limits.body_timeout_s:g}s (rollout.openai.body_timeout_s)"
            ) from None
        try:
            body = json.loads(raw, parse_constant=_not_json)
        except ValueError as exc:
            raise web.HTTPBadRequest(reason=f"malformed JSON: {one_line(exc, 300)}") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(reason="malformed request: the body must be a JSON object")
        return body


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (only finite numbers are)")


def _ok(payload: dict[str, Any]) -> Any:
    from aiohttp import web

    return web.json_response(payload)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> Any:
    from aiohttp import web

    payload = {"error": {"message": " ".join(message.split())[:500], "type": kind, "code": status}}
    return web.json_response(payload, status=status)


def _power_of_ten(n: int) -> bool:
    return n >= 10 and str(n).strip("0") == "1"
