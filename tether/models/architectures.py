"""Which model families tether trains and serves, checked from a model folder before anything starts.

The trainer shards each decoder layer with FSDP2 (it finds them at ``model.model.layers``), the LM head
is read through ``get_output_embeddings`` (trainer/head.py), and the embedded engine decodes with a KV
cache, left padding and explicit position ids. Every family in ``SUPPORTED`` runs all of it in the test
suite at its real vocabulary size (tests/integration/test_architectures.py): the engine serves it, its
log-probs equal the trainer's in float32, a weight push changes its replies, an FSDP checkpoint
resumes. A family with another layout is refused here by name, with the reason, instead of failing
somewhere inside a Ray actor. A decoder-only model of a family not listed but laid out the same way
(``model.model.layers``) is let through with a warning that it is untested.
"""

from __future__ import annotations

import warnings

from tether.errors import ConfigError

SUPPORTED = {
    "llama": "Llama 2/3, SmolLM2, TinyLlama",
    "qwen2": "Qwen2, Qwen2.5",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "mistral": "Mistral",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 text models (1B; the larger ones' text part)",
    "phi3": "Phi-3, Phi-3.5, Phi-4-mini",
}
# model_type: why it is refused
REFUSED = {
    "gpt2": "its blocks sit at transformer.h and it has learned absolute positions; the trainer shards "
            "model.model.layers and the engine's left-padded batches give explicit position ids",
    "gpt_neox": "its blocks sit at gpt_neox.layers (the trainer shards model.model.layers)",
    "opt": "its blocks sit at model.decoder.layers and it derives positions from the attention mask",
    "gemma3": "this is the multimodal Gemma 3 (Gemma3ForConditionalGeneration); its language model is at "
              "model.language_model: use a text-only Gemma 3 (model_type gemma3_text)",
}


class UnsupportedModel(ConfigError):
    """The model folder holds an architecture tether cannot train or serve; the message says why."""


def _supported_list() -> str:
    return ", ".join(sorted(SUPPORTED))


def check_architecture(path: str, field: str = "model.path") -> str:
    """The folder's model_type, when tether can train and serve it; UnsupportedModel otherwise.

    Builds the model on the meta device (no memory, no weights read) to see that it is a causal LM with
    its decoder layers where the trainer looks for them.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tether.trainer.model import decoder_layers

    config = AutoConfig.from_pretrained(path)
    model_type = config.model_type
    where = f"{field}: {path}"
    if model_type in REFUSED:
        raise UnsupportedModel(f"{where}: model_type '{model_type}' is not supported: {REFUSED[model_type]}. "
                               f"Supported: {_supported_list()}")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as err:  # not registered as a causal LM (an encoder, a seq2seq model)
        raise UnsupportedModel(f"{where}: model_type '{model_type}' is not a causal language model "
                               f"({str(err).splitlines()[0]}). Supported: {_supported_list()}") from None
    try:
        decoder_layers(model)
    except ValueError:
        raise UnsupportedModel(f"{where}: model_type '{model_type}' ({type(model).__name__}) has no decoder layers "
                               f"at model.model.layers, where the trainer shards them. Supported: "
                               f"{_supported_list()}") from None
    if model_type not in SUPPORTED:
        warnings.warn(f"{where}: model_type '{model_type}' is laid out like the supported families but is not "
                      f"tested by tether (tested: {_supported_list()})", stacklevel=2)
    return model_type
