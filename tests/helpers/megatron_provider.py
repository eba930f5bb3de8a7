"""An example `trainer.megatron.model_provider`: bring your own megatron-core GPTModel.

    trainer.megatron.model_provider=tests.helpers.megatron_provider:my_gpt

The provider is called on every trainer rank after megatron's parallel state exists, with
the HF config of `model.path` and the TransformerConfig Tandem derived from it (change
what you need), and returns this rank's pipeline stage. Tandem wraps it in MegatronActor
and loads `model.path`'s weights into it.
"""

from __future__ import annotations

from typing import Any

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from roles.megatron.model import MegatronActor


def my_gpt(hf_config: Any, config: Any) -> MegatronActor:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vocab = -(-hf_config.vocab_size // tp) * tp  # the vocab-parallel layers need a multiple of TP
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=hf_config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(hf_config.rope_parameters["rope_theta"]),
    )
    return MegatronActor(model, vocab_size=hf_config.vocab_size)
