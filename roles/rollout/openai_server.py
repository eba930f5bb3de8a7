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
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from roles.rollout import openai_calls
from roles.rollout.agent_episode import AgentEpisode, CallRefused
from roles.rollout.chat_render import ChatRenderer
from runtime.errors import one_line
from runtime.logs import get_logger
from runtime.run_token import read_token

log = get_logger("rollout")
EPISODE_HEADER = "X-Tandem-Episode"
MAX_BODY_BYTES = 32 * 2**20


def endpoint_key(run_dir: str | Path) -> str:
    """The key agents present to this run's endpoints (derived from the run token)."""
    return hmac.new(read_token(run_dir).encode(), b"tandem-openai-endpoint", hashlib.sha256).hexdigest()


class EndpointServer:
    def __init__(self, renderer: ChatRenderer, key: str, *, model: str, max_model_len: int) -> None:
        self.renderer = renderer
        self.key = key
        self.model = model
        self.max_model_len = max_model_len
        self.episodes: dict[str, AgentEpisode] = {}
        self.refused = 0
        self.failed = 0
        self.base_url = ""
        self._runner: Any = None

    async def start(self, host: str, port: int) -> str:
        """Serve; returns the base address (`http://HOST:PORT`)."""
        from aiohttp import web

        @web.middleware
        async def guard(request: Any, handler: Any) -> Any:
            return await self._guard(request, handler)

        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[guard])
        for prefix in ("/episodes/{episode}/v1", "/v1"):
            app.router.add_post(f"{prefix}/chat/completions", self._call(openai_calls.chat))
            app.router.add_post(f"{prefix}/completions", self._call(openai_calls.complete))
            app.router.add_get(f"{prefix}/models", self._models)
        app.router.add_post("/episodes/{episode}/reward", self._reward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{shown}:{bound[1]}"
        return self.base_url

    async def close(self) -> None:
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
            body = await _json(request)
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
        body = await _json(request)
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            return _error(400, "invalid request: reward: a number is needed")
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


async def _json(request: Any) -> dict[str, Any]:
    from aiohttp import web

    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        raise web.HTTPBadRequest(reason=f"malformed JSON: {one_line(exc, 300)}") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(reason="malformed request: the body must be a JSON object")
    return body


def _ok(payload: dict[str, Any]) -> Any:
    from aiohttp import web

    return web.json_response(payload)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> Any:
    from aiohttp import web

    payload = {"error": {"message": " ".join(message.split())[:500], "type": kind, "code": status}}
    return web.json_response(payload, status=status)


def _power_of_ten(n: int) -> bool:
    return n >= 10 and str(n).strip("0") == "1"
