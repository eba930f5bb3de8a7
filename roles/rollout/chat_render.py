"""Chat templating and tool-call parsing for the OpenAI-compatible endpoint, done with
vLLM's own server code so a request renders as `vllm serve` would render it for the model.

What a caller may rely on:
* `render(messages, tools)` is vLLM's: `parse_chat_messages` (content parts, tool-call
  arguments as dicts), then `safe_apply_chat_template` with the model's chat template;
  its text is tokenized without special tokens added, as vLLM's chat server does.
* `continuation(before, after, tools, completion_text)` is the text that follows a sampled
  assistant turn when the conversation `before` (which ends with that turn) grows into
  `after`: what the template puts after the turn (`<|im_end|>\\n`, less what the sampled
  tokens already hold) and the rendering of the new messages, ending with the next
  generation prompt. None when the template does not render `after` as `before` plus more
  (a template that rewrites earlier turns): the caller then renders `after` whole.
* The tool parser `rollout.openai.tool_parser` (`hermes` for Qwen2.5 / Hermes models) is
  vLLM's, composed as `vllm serve --tool-call-parser NAME --enable-auto-tool-choice`
  composes it. `adjust(request)` is its `adjust_request`, as vLLM's server applies it
  before sampling: `tool_choice` "required" or a named function gets the grammar of a tool
  call (`request.extract_structured_outputs()` then returns it, as it returns the grammar
  of a `response_format`). `parse_reply(text, request)` splits a reply into content and
  tool calls as vLLM's server does for every `tool_choice`.
"""

from __future__ import annotations

from typing import Any

_PROBE = "\u2063tandem\u2063"  # a marker no template rewrites, to find a turn's closing text


class ChatRenderer:
    def __init__(self, model_config: Any, tokenizer: Any, tool_parser: str) -> None:
        from vllm.parser import ParserManager

        self.model_config = model_config
        self.tokenizer = tokenizer
        self.parser_cls = ParserManager.get_parser(
            tool_parser_name=tool_parser or None,
            enable_auto_tools=True,
            model_name=model_config.model,
            tokenizer=tokenizer,
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        generation_prompt: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text vLLM's chat server would build for `messages`."""
        from vllm.renderers.chat_utils import parse_chat_messages
        from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

        fmt = resolve_chat_template_content_format(None, tools, "auto", self.tokenizer, model_config=self.model_config)
        conversation, _, _ = parse_chat_messages(list[Any](messages), self.model_config, content_format=fmt)
        extra = dict(kwargs or {})
        extra["add_generation_prompt"] = generation_prompt
        text = safe_apply_chat_template(
            self.model_config, self.tokenizer, conversation, tools=tools, tokenize=False, **extra
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def continuation(
        self,
        before: list[dict[str, Any]],
        after: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        completion_text: str,
        kwargs: dict[str, Any] | None = None,
    ) -> str | None:
        """See the module docs; `before` ends with the assistant turn sampled as `completion_text`."""
        done = self.render(before, tools, generation_prompt=False, kwargs=kwargs)
        full = self.render(after, tools, kwargs=kwargs)
        if not full.startswith(done):
            return None
        return self._closing(before, tools, completion_text, kwargs) + full[len(done) :]

    def _closing(
        self,
        before: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        completion_text: str,
        kwargs: dict[str, Any] | None,
    ) -> str:
        """What the template writes after the sampled turn that the sampled tokens lack."""
        opened = self.render(before[:-1], tools, kwargs=kwargs)
        turn = self.render(before, tools, generation_prompt=False, kwargs=kwargs)
        if turn.startswith(opened) and turn[len(opened) :].startswith(completion_text):
            return turn[len(opened) + len(completion_text) :]
        end = self._turn_end(before[:-1], tools, kwargs)
        for k in range(min(len(end), len(completion_text)), 0, -1):  # the stop token may already be there
            if completion_text.endswith(end[:k]):
                return end[k:]
        return end

    def _turn_end(self, history: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: Any) -> str:
        """The text the template puts after an assistant turn's content (`<|im_end|>\\n`)."""
        probe = [*history, {"role": "assistant", "content": _PROBE}]
        text = self.render(probe, tools, generation_prompt=False, kwargs=kwargs)
        return text[text.rindex(_PROBE) + len(_PROBE) :] if _PROBE in text else ""

    def adjust(self, request: Any) -> Any:
        """`request` as vLLM's server samples it (see the module docs); raises ValueError
        (vLLM's message) for a tool_choice it cannot serve."""
        if self.parser_cls is None:
            if request.tools and forces_call(request):
                raise ValueError("a tool_choice that forces a call needs rollout.openai.tool_parser")
            return request
        if request.tool_choice == "none" and not self.parser_cls.always_adjust_request:
            return request
        return self._parser(request).adjust_request(request)

    def parse_reply(self, text: str, request: Any) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls as OpenAI dicts) of a reply, as vLLM's chat server builds its
        message: calls only where `tool_choice` asks for them ("auto", "required", a named
        function; at most one with `parallel_tool_calls: false`)."""
        if self.parser_cls is None:
            return text, []
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.renderers.chat_utils import make_tool_call_id

        _, content, found = self._parser(request).parse(text, request, enable_auto_tools=True)
        forced = forces_call(request)
        if not request.tools or not (forced or request.tool_choice == "auto"):
            return content, []
        calls = [ToolCall(id=c.id or make_tool_call_id(), function=c).model_dump() for c in found or []]
        if request.parallel_tool_calls is False:
            calls = calls[:1]
        return (content or "") if forced else content, calls

    def _parser(self, request: Any) -> Any:
        assert self.parser_cls is not None
        config, kwargs = self.model_config, request.chat_template_kwargs
        return self.parser_cls(self.tokenizer, request.tools, model_config=config, chat_template_kwargs=kwargs)


def forces_call(request: Any) -> bool:
    """Whether `tool_choice` is "required" or names a function."""
    return request.tool_choice not in (None, "none", "auto")
