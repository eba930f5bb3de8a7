"""The real megatron-core `GPTModel` built on CPU over gloo (megatron-core is installed by
.ci/setup): HF weights load into it and export back bit for bit at several TP / PP splits,
the critic's value model keeps the trunk, and replica ranks gather shards in rank order.
Each case builds models in subprocesses (1.5-5 min each on 2 cores): `slow`. The layout
arithmetic alone is tests/unit/roles/training/test_megatron_convert.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.tiny.model import make_tiny_model
from tests.conftest import ROOT
from tests.helpers.ports import rendezvous_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("megatron-tiny")
    return {tied: make_tiny_model(root / str(tied), num_layers=2, tie_word_embeddings=tied) for tied in (True, False)}


# Tied embeddings with PP > 1 sync the last stage's copy over CUDA when the model is built:
# GPU only (tests/gpu/test_megatron.py).
# The provider case is a user's own GPTModel (tests/helpers/megatron_provider.py, the
# README's example) going through the same load and export.
@pytest.mark.parametrize(
    ("tied", "tp", "pp", "provider"),
    [(True, 1, 1, ""), (True, 2, 1, ""), (False, 1, 2, ""), (True, 2, 1, "tests.helpers.megatron_provider:my_gpt")],
)
def test_real_gpt_model_loads_and_exports_hf_weights_bit_exact(
    tiny_dirs: dict[bool, Path], tied: bool, tp: int, pp: int, provider: str
) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is installed by .ci/setup")
    cmd = [sys.executable, "-m", "tests.helpers.megatron_cpu", str(tiny_dirs[tied]), str(tp), str(pp), provider]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exported"] == result["expected"]
    assert result["differ"] == []


def test_critic_value_model_loads_the_policy_trunk_with_a_zero_scalar_head(tiny_dirs: dict[bool, Path]) -> None:
    """critic.backend=megatron: the GPTModel's output layer is a scalar head; every other
    parameter holds the HF weights bit for bit (exported back, TP=2), the head starts at zero."""
    pytest.importorskip("megatron.core", reason="megatron-core is installed by .ci/setup")
    cmd = [sys.executable, "-m", "tests.helpers.megatron_cpu", str(tiny_dirs[True]), "2", "1", "critic"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exported"] == result["expected"]
    assert result["differ"] == []
    assert result["head"] == {"output_layer.score.weight": 0.0}


def _gather_worker(rank: int, world: int, rendezvous: str, out: str) -> None:

    import torch.distributed as dist

    from roles.megatron.engine_base import gather_shards
    from transport.wire import TrainBatch

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    lengths = [[3, 5], [], [4]][rank]  # rank 1 holds no sequence
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
    base = 100 * (rank + 1)
    batch = TrainBatch(
        step=3, input_ids=torch.arange(base, base + n), cu_seqlens=cu, loss_mask=torch.ones(n),
        behaviour_logprobs=-torch.arange(n, dtype=torch.float32), advantages=torch.full((n,), float(rank)),
        global_num_tokens=12, global_num_seqs=3, returns=torch.zeros(n),
    )  # fmt: skip
    got = gather_shards(batch, dist.group.WORLD, torch.device("cpu"))
    torch.save(
        {k: getattr(got, k) for k in ("input_ids", "cu_seqlens", "advantages", "returns", "global_num_tokens")},
        f"{out}/rank{rank}.pt",
    )
    dist.destroy_process_group()


def test_replica_ranks_gather_each_others_shards_in_rank_order(tmp_path: Path) -> None:
    """What the Megatron engine does first: TP/PP ranks of a replica train the same sequences."""
    import torch.multiprocessing as mp

    mp.spawn(_gather_worker, args=(3, rendezvous_file(tmp_path), str(tmp_path)), nprocs=3, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    want_ids = torch.cat([torch.arange(100, 108), torch.arange(300, 304)])
    for r in results:
        assert torch.equal(r["input_ids"], want_ids)
        assert r["cu_seqlens"].tolist() == [0, 3, 8, 12]
        assert r["advantages"].tolist() == [0.0] * 8 + [2.0] * 4
        assert r["returns"].shape == (12,) and r["global_num_tokens"] == 12
