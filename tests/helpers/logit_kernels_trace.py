"""`python -m tests.helpers.logit_kernels_trace G_LOGP G_ENTROPY` (1/0 each): compile the
chunked head's logit kernels as CUDA does (fullgraph, dynamic rows; aot_eager: the trace,
not inductor) in a fresh interpreter, where no earlier import (vLLM's) has changed
torch._dynamo's configuration, and check them against the eager math for a full and a
short last chunk. Exits 0 and prints "ok", or raises."""

from __future__ import annotations

import sys

import torch

from roles.kernels.logit_kernels import grad_of_logits, stats_of_logits


def main(g_logp: bool, g_entropy: bool) -> None:
    stats = torch.compile(stats_of_logits, backend="aot_eager", dynamic=True, fullgraph=True)
    grad = torch.compile(grad_of_logits, backend="aot_eager", dynamic=True, fullgraph=True)
    torch.manual_seed(2)
    for rows in (16, 5):
        logits, t = (torch.randn(rows, 300) * 4).bfloat16(), torch.randint(0, 300, (rows,))
        want = stats_of_logits(logits, t)
        for a, b in zip(stats(logits, t), want, strict=True):
            torch.testing.assert_close(a, b)
        _, entropy, lse = want
        up = (torch.randn(rows) if g_logp else None, torch.randn(rows) if g_entropy else None)
        torch.testing.assert_close(
            grad(logits, t, lse, entropy, *up, torch.bfloat16),
            grad_of_logits(logits, t, lse, entropy, *up, torch.bfloat16),
        )
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1] == "1", sys.argv[2] == "1")
