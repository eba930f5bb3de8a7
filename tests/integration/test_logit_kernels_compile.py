"""The chunked head's logit kernels as CUDA compiles them (`torch.compile`, fullgraph,
dynamic rows) trace without a graph break and equal the eager math. Compiling takes about
a minute on 2 cores, so this lives outside the unit tier."""

from __future__ import annotations

import pytest
import torch

from roles.training.logit_kernels import grad_of_logits, stats_of_logits


@pytest.mark.parametrize("g_logp,g_entropy", [(True, True), (True, False), (False, True)])
def test_logit_kernels_trace_whole_and_equal_eager(g_logp: bool, g_entropy: bool) -> None:
    """What CUDA compiles (fullgraph, dynamic rows) traces without a graph break and equals
    the eager math, for a full and a short last chunk (aot_eager: the trace, not inductor)."""
    torch._dynamo.reset()
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
