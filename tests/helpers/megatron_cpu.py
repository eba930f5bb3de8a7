"""Megatron-core on CPU for the tests: build the real `GPTModel` (construction runs on CPU;
its forward does not), load an HF directory into it and export it back.

`python -m tests.helpers.megatron_cpu MODEL_DIR TP PP [PROVIDER]` runs TP x PP gloo ranks and prints
one JSON line from rank 0: the HF names it exported, and those whose tensors differ
bit for bit from the HF files. PROVIDER `critic` builds the critic's value model instead
(the GPTModel with a scalar head) and adds the head's names and largest magnitude.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.ports import rendezvous_file


def _worker(rank: int, world: int, rendezvous: str, model_dir: str, tp: int, pp: int, provider: str) -> None:
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from roles.megatron.convert import ModelDims
    from roles.megatron.model import (
        VALUE_HEAD,
        build_value_model,
        export_hf_weights,
        load_hf_weights,
        make_actor,
        parameters_by_name,
        transformer_config,
    )

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    dims = ModelDims.from_hf_config(AutoConfig.from_pretrained(model_dir))
    config = transformer_config(dims, tp=tp, pp=pp, dtype=torch.float32, recompute=False)
    config = dataclasses.replace(config, use_cpu_initialization=True)
    head: dict[str, float] = {}
    if provider == "critic":
        actor = build_value_model(dims, config, torch.device("cpu"))
        load_hf_weights(actor, Path(model_dir), dims, skip=VALUE_HEAD)
        params = parameters_by_name(actor)
        head = {k: float(v.abs().max()) for k, v in params.items() if k.startswith(VALUE_HEAD)}
    else:
        actor = make_actor(provider, AutoConfig.from_pretrained(model_dir), config, dims, torch.device("cpu"))
        load_hf_weights(actor, Path(model_dir), dims)
    exported = dict(export_hf_weights(actor, dims, torch.float32))
    if rank == 0:
        want = load_file(str(Path(model_dir) / "model.safetensors"))
        if dims.tied:
            want.pop("lm_head.weight", None)
        differ = sorted(k for k in want if k not in exported or not torch.equal(exported[k], want[k].float()))
        result = {"exported": sorted(exported), "expected": sorted(want), "differ": differ, "head": head}
        print(json.dumps(result), flush=True)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    model_dir, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    provider = sys.argv[4] if len(sys.argv) > 4 else ""
    mp.spawn(_worker, args=(tp * pp, rendezvous_file(), model_dir, tp, pp, provider), nprocs=tp * pp, join=True)


if __name__ == "__main__":
    main()
