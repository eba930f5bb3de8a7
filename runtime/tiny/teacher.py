"""A tiny teacher for on-policy distillation on CPU, made on the fly (`algorithm.distill.teacher:
tiny`): the tiny model of its own seed and shape (runtime/tiny/model.py), then briefly trained
to put its next-token mass on the lowercase letters, whatever the context.

A random tiny model is no teacher a tiny student can imitate in a few dozen steps (its
preferences are context-dependent noise); one that knows one simple thing is: the student's
reverse KL to it falls by orders of magnitude within 30 on-policy steps, and, as the copy
task rewards letters of the prompt, its task reward rises with it.

What a caller may rely on: `make_tiny_teacher(path, tiny, train_steps)` writes a complete HF
directory (the byte tokenizer, the same as the tiny policy's) and returns it; the same
arguments give the same weights, and a directory already made with them is reused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from runtime.hf_quiet import no_progress_bars
from runtime.tiny.model import make_tiny_model

_STAMP = "tandem_teacher.json"
LETTERS = range(ord("a"), ord("z") + 1)  # byte tokenizer: token id == byte value
BATCH, LENGTH, LR = 16, 40, 0.01


def make_tiny_teacher(path: str | os.PathLike[str], tiny: dict[str, Any], train_steps: int) -> Path:
    if train_steps == 0:  # a random teacher: the tiny model as it is made
        return make_tiny_model(path, **tiny)
    out = Path(path)
    spec = {"tiny": tiny, "train_steps": train_steps}
    if _stamp(out) == spec:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    base = make_tiny_model(out.parent / f".{out.name}-init", **tiny)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    _train(base, tmp, int(tiny.get("seed", 0)), train_steps)
    (tmp / _STAMP).write_text(json.dumps(spec))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _stamp(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / _STAMP).read_text())  # type: ignore[no-any-return]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _train(base: Path, out: Path, seed: int, steps: int) -> None:
    """`steps` AdamW steps of cross-entropy towards the uniform distribution over the
    lowercase letters at every position of random byte sequences; saved in bfloat16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    letters = torch.tensor(list(LETTERS))
    for _ in range(steps):
        x = torch.randint(0, 256, (BATCH, LENGTH), generator=gen)
        logp = torch.log_softmax(model(x).logits.float(), -1)
        loss = -logp[..., letters].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with no_progress_bars():
        model.bfloat16().save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(out)
