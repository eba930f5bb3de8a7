"""A tiny random-initialised Qwen2 (or Qwen3-MoE) model and byte-level tokenizer, made on the fly.

`make_tiny_model(path, ...)` writes a complete HF model directory (config, safetensors
weights, tokenizer.json with a chat template) that transformers and vLLM load with no
network access. The same arguments and seed always give the same weights, and a
directory that already holds a model made with the same arguments is reused as is.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from runtime.hf_quiet import no_progress_bars

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_STAMP = "tandem_tiny.json"


def byte_vocab() -> dict[str, int]:
    """The byte-level vocabulary: the 256 GPT-2 byte symbols, then the special tokens."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {sym: i for i, sym in enumerate(alphabet)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    return vocab


def _byte_of(symbol: str) -> int:
    """Order GPT-2 byte symbols by the byte they stand for, so id == byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table[symbol]


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """A byte-level tokenizer (no merges): token id == byte value for ids < 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    path: str | os.PathLike[str],
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    classifier: bool = False,
    vocab_size: int = 0,
    initializer_range: float = 0.02,
    num_experts: int = 0,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
) -> Path:
    """Write a random-initialised Qwen2 model with the byte tokenizer into `path`.

    `classifier`: a `Qwen2ForSequenceClassification` with one label (a reward model)
    instead of the causal LM. `vocab_size` 0 is the byte tokenizer's (259); a larger one
    (151936 is Qwen2.5's) gives the model that many embedding rows and logits, of which the
    tokenizer names the first 259: ids above are valid model inputs and outputs that decode
    to nothing. `initializer_range`: the std of the random weights (transformers' default
    0.02 makes nearly uniform next-token distributions).

    Returns the directory. Re-running with the same arguments on an existing
    directory does nothing; different arguments rebuild it. Writes go to a temporary
    sibling that is renamed into place, so a reader never sees half a model.
    """
    spec: dict[str, float] = dict(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
    )
    if classifier:  # only then: the policy's digest (and a reused directory) stay as they were
        spec["classifier"] = True
    if vocab_size:  # absent by default, so models made before the option keep their digest
        spec["vocab_size"] = vocab_size
    if initializer_range != 0.02:  # the same
        spec["initializer_range"] = initializer_range
    if num_experts and not classifier:  # the same (a tiny reward model stays dense)
        spec.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
        )
    out = Path(path)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    stamp = out / _STAMP
    if _same(stamp, digest):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    _write_model(tmp, spec)
    (tmp / _STAMP).write_text(json.dumps({"digest": digest, "spec": spec}))
    if out.exists() and not _same(stamp, digest):
        _remove_tree(out)
    try:
        os.replace(tmp, out)
    except OSError:
        # Another process (a launcher on another node sharing the file system) won the
        # race; its model is the same if the stamp matches.
        _remove_tree(tmp)
        if not _same(stamp, digest):
            raise
    return out


def _same(stamp: Path, digest: str) -> bool:
    try:
        return bool(json.loads(stamp.read_text()).get("digest") == digest)
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def _write_model(directory: Path, spec: dict) -> None:
    import torch
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=max(len(tokenizer), spec.get("vocab_size", 0)),
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=spec["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        initializer_range=spec.get("initializer_range", 0.02),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    kind: type = Qwen2ForCausalLM
    config: Any
    if spec.get("num_experts"):
        config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a config attribute the stub lacks
            **common,
            head_dim=spec["hidden_size"] // spec["num_heads"],
            num_experts=spec["num_experts"],
            num_experts_per_tok=spec["num_experts_per_tok"],
            moe_intermediate_size=spec["moe_intermediate_size"],
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
        kind = Qwen3MoeForCausalLM
    else:
        config = Qwen2Config(**common)
    if spec.get("classifier"):
        config.num_labels = 1  # one label: the reward
        kind = Qwen2ForSequenceClassification
    torch.manual_seed(spec["seed"])
    model = kind(config).bfloat16()  # initialised in float32 (as before), then cast
    if not spec.get("classifier"):
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    with no_progress_bars():  # transformers' "Writing model shards" bar, for one tiny shard
        model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
