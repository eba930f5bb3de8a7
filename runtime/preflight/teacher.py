"""Launch checks of on-policy distillation's teacher (`algorithm.distill.teacher`).

The teacher scores the student's token ids as they are: its tokenizer must map every id to
the same token as the policy's. `tokenizer_mismatch` names the first id where they differ;
the launcher refuses such a run in one line (exit 2) before any role starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.errors import ConfigError


def id_to_token(tokenizer: Any) -> dict[int, str]:
    """Every id the tokenizer knows (added tokens included) and its token string."""
    table = {int(i): str(tok) for tok, i in tokenizer.get_vocab().items()}
    for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        table[int(i)] = str(getattr(added, "content", added))
    return table


def tokenizer_mismatch(student: Any, teacher: Any) -> str:
    """ "" when both tokenizers map every id to the same token, else where they first differ:
    `token id 7: 'a' in the policy's, 'b' in the teacher's` (`(none)` where one lacks it)."""
    s, t = id_to_token(student), id_to_token(teacher)
    for i in sorted(set(s) | set(t)):
        a, b = s.get(i), t.get(i)
        if a != b:
            return f"token id {i}: {_show(a)} in the policy's, {_show(b)} in the teacher's"
    return ""


def _show(token: str | None) -> str:
    return "(none)" if token is None else repr(token)


def check_teacher_tokenizer(policy_dir: Path, teacher_dir: Path) -> None:
    """ConfigError (one line naming `algorithm.distill.teacher` and the first differing
    token) when the teacher's tokenizer is not the policy's."""
    from transformers import AutoTokenizer

    try:
        teacher = AutoTokenizer.from_pretrained(str(teacher_dir))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"algorithm.distill.teacher '{teacher_dir}': no tokenizer: {exc}".splitlines()[0]) from None
    why = tokenizer_mismatch(AutoTokenizer.from_pretrained(str(policy_dir)), teacher)
    if why:
        raise ConfigError(
            f"algorithm.distill.teacher '{teacher_dir}': its tokenizer differs from the policy's at {why}; "
            "the teacher must score the policy's token ids (use a teacher of the same tokenizer family)"
        )
