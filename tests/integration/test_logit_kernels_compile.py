"""The chunked head's logit kernels as CUDA compiles them (`torch.compile`, fullgraph,
dynamic rows) trace without a graph break and equal the eager math. Each case compiles in
a fresh interpreter (tests/helpers/logit_kernels_trace.py): in a worker that imported vLLM
before, torch._dynamo's configuration is not the stock one. About a minute on 2 cores, so
this lives outside the unit tier."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("g_logp,g_entropy", [(True, True), (True, False), (False, True)])
def test_logit_kernels_trace_whole_and_equal_eager(g_logp: bool, g_entropy: bool) -> None:
    cmd = [sys.executable, "-m", "tests.helpers.logit_kernels_trace", str(int(g_logp)), str(int(g_entropy))]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"
