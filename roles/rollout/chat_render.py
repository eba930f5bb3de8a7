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
* `parse_reply(text, request)` splits a reply into content and tool calls with vLLM's tool
  parser `rollout.openai.tool_parser` (`hermes` for Qwen2.5 / Hermes models), as vLLM's
  server does for `tool_choice: auto`.
"""

from __future__ import annotations

from typing import Any

_PROBE = "\u2063tandem\u2063"  # a marker no template rewrites, to find a turn's closing text


class ChatRenderer:
    def __init__(self, model_config: Any, tokenizer: Any, tool_parser: str) -> None:
        from vllm.tool_parsers import ToolParserManager

        self.model_config = model_config
        self.tokenizer = tokenizer
        self.parser_cls = ToolParserManager.get_tool_parser(tool_parser) if tool_parser else None

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation_prompt: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> str:  # fmt: skip
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
        self, before: list[dict[str, Any]], after: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
        completion_text: str, kwargs: dict[str, Any] | None = None,
    ) -> str | None:  # fmt: skip
        """See the module docs; `before` ends with the assistant turn sampled as `completion_text`."""
        done = self.render(before, tools, generation_prompt=False, kwargs=kwargs)
        full = self.render(after, tools, kwargs=kwargs)
        if not full.startswith(done):
            return None
        return self._closing(before, tools, completion_text, kwargs) + full[len(done) :]

    def _closing(
        self, before: list[dict[str, Any]], tools: list[dict[str, Any]] | None, completion_text: str,
        kwargs: dict[str, Any] | None,
    ) -> str:  # fmt: skip
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

    def parse_reply(self, text: str, request: Any) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls as OpenAI dicts) of a reply; no tools asked for: all content."""
        if self.parser_cls is None or not request.tools or request.tool_choice == "none":
            return text, []
        parser = self.parser_cls(self.tokenizer, request.tools)
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        return info.content or None, [call.model_dump() for call in info.tool_calls]
