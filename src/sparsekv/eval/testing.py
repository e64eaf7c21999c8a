"""A tiny offline model + byte-level tokenizer for smoke runs of the harness (tests, CI, trying a new task).

The numbers it produces mean nothing; it only exercises every code path in seconds without any download.
"""

from __future__ import annotations

from sparsekv.eval.common import ModelHandle


def byte_tokenizer():
    """A fast tokenizer with one token per byte (256) plus <pad>/<s>/</s>; no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_handle(layers: int = 4, seed: int = 0) -> ModelHandle:
    """A random tiny Llama (`layers` layers, 4 query / 2 kv heads) with the byte tokenizer, as a ModelHandle."""
    from sparsekv.models import random_model

    model = random_model("tiny-llama", num_hidden_layers=layers, vocab_size=320, seed=seed)
    return ModelHandle(spec="tiny", model=model, tokenizer=byte_tokenizer(), name=f"tiny-llama-{layers}-{seed}")
