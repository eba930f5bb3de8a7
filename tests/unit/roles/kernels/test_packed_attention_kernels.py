"""`trainer.attention_kernel=fa4|cudnn` without a GPU: what CI can hold of them.

For each kernel (roles/kernels/varlen_fa4.py, roles/kernels/varlen_cudnn.py, both built by
roles/kernels/varlen_ops.py):

* the two custom ops have fake kernels of the real shapes, and their autograd wiring runs a
  backward (on meta tensors, which dispatch to the fakes: no CUDA, no kernel), with gradients
  of q, k and v's shapes (GQA: k and v have fewer heads);
* a compiled function traces the op as one node (fake tensors, no kernel run);
* off CUDA or in fp32 the backend is roles/kernels/varlen.py's path, value for value;
* a launch that cannot run it is refused with one line naming the field.

And cudnn's log-sum-exp crosses between forward and backward as `[H, T]` whichever layout
this torch's cuDNN path gives, and goes back to the backward in that layout, value for value.
The kernels themselves against PyTorch's FA2 varlen: tests/gpu/test_attention_kernels_gpu.py.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from roles.kernels import varlen_cudnn
from roles.kernels.varlen import varlen_attention_forward
from roles.kernels.varlen_cudnn import cudnn_attention_forward, cudnn_varlen
from roles.kernels.varlen_fa4 import fa4_attention_forward, fa4_varlen
from runtime.config.load import load_config
from runtime.errors import ConfigError
from runtime.preflight.environment import check_launch
from tests.helpers.one_rank import ONE_GPU_ENGINE

T, H, HKV, D = 37, 6, 2, 16
OPS: dict[str, tuple[Any, Callable[..., Any]]] = {
    "fa4": (fa4_varlen, fa4_attention_forward),
    "cudnn": (cudnn_varlen, cudnn_attention_forward),
}
KERNELS = sorted(OPS)


def _qkv(device: str, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    shapes = [(T, H, D), (T, HKV, D), (T, HKV, D)]
    return tuple(torch.randn(s, dtype=torch.bfloat16, device=device, requires_grad=requires_grad) for s in shapes)


@pytest.mark.parametrize("kernel", KERNELS)
def test_fakes_and_autograd_give_the_real_shapes(kernel: str) -> None:
    q, k, v = _qkv("meta", requires_grad=True)
    cu = torch.tensor([0, 10, 37], dtype=torch.int32, device="meta")
    out, lse = OPS[kernel][0](q, k, v, cu, 27, D**-0.5)
    assert out.shape == (T, H, D) and out.dtype == torch.bfloat16
    assert lse.shape == (H, T) and lse.dtype == torch.float32
    out.float().sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == ((T, H, D), (T, HKV, D), (T, HKV, D))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_traced_function_holds_the_op_as_one_node(kernel: str) -> None:
    op = OPS[kernel][0]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        return op(q, k, v, cu, 27, D**-0.5)[0] * 2

    with FakeTensorMode():
        q, k, v = _qkv("cpu")
        graph = make_fx(attend, tracing_mode="fake")(q, k, v, torch.tensor([0, 10, 37], dtype=torch.int32))
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count(f"tandem.{kernel}_varlen.default") == 1, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_off_cuda_the_backend_is_the_torch_path(kernel: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, T, D, dtype=dtype) for h in (H, HKV, HKV))
    cu = torch.tensor([0, 10, 37], dtype=torch.int32)
    module = torch.nn.Identity()
    got, _ = OPS[kernel][1](module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=27)
    want, _ = varlen_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=27)
    assert torch.equal(got, want) and got.shape == (1, T, H, D)


@pytest.mark.parametrize("native", [(H, T), (T, H), (T, H, 1)])
def test_cudnn_log_sum_exp_layout_round_trips(native: tuple[int, ...]) -> None:
    lse_HT = torch.randn(H, T)
    given = lse_HT.t().reshape(native).contiguous() if native != (H, T) else lse_HT.clone()
    heads_first = varlen_cudnn._lse_to_heads_first(given, H, T)
    assert torch.equal(heads_first, lse_HT)  # the same numbers, head by head
    back = varlen_cudnn._lse_for_backward(heads_first)
    assert back.shape == native and torch.equal(back, given)
    with pytest.raises(RuntimeError, match=r"log-sum-exp of shape \(5, 5\)"):
        varlen_cudnn._lse_to_heads_first(torch.zeros(5, 5), H, T)


@pytest.mark.parametrize("kernel", KERNELS)
def test_launch_refuses_the_kernel_where_it_cannot_run(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    option = [f"trainer.attention_kernel={kernel}"]
    field = rf"^trainer.attention_kernel={kernel}"
    with pytest.raises(ConfigError, match=rf"{field} applies to the FSDP actor only"):
        check_launch(load_config(None, [*option, "trainer.backend=megatron"]))
    with pytest.raises(ConfigError, match=rf"{field} needs trainer.packing=true"):
        check_launch(load_config(None, [*option, "trainer.packing=false", *ONE_GPU_ENGINE]))
    with pytest.raises(ConfigError, match=rf"{field} needs trainer.device=cuda"):
        check_launch(load_config(None, [*option, "trainer.device=cpu"]))
    if kernel == "fa4":

        def missing(name: str) -> importlib.metadata.Distribution:
            raise importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(importlib.metadata, "distribution", missing)
        with pytest.raises(ConfigError, match=rf"{field} needs the flash-attn-4 package"):
            check_launch(load_config(None, [*option, *ONE_GPU_ENGINE]))
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8907)
        with pytest.raises(ConfigError, match=rf"{field} needs cuDNN 9 or later \(this torch has cuDNN 8907\)"):
            check_launch(load_config(None, [*option, *ONE_GPU_ENGINE]))
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
        check_launch(load_config(None, [*option, *ONE_GPU_ENGINE]))  # accepted
    with pytest.raises(ConfigError, match=r"trainer\.attention_kernel"):
        load_config(None, ["trainer.attention_kernel=fa3"])
