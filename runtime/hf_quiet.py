"""transformers without its progress bars: `Writing model shards` and `Loading weights` are
tqdm bars on stderr, noise around a one-line CLI (`tandem launch` making the tiny model,
`tandem export --merge`) and in a log file.

What a caller may rely on: inside `no_progress_bars()` transformers (and huggingface_hub)
draw no bar; afterwards they draw them again only if they did before."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
