"""Character-level tokenizer for the tiny from-scratch models.

Built locally with the `tokenizers` library (no hub) and saved as an ordinary Hugging Face
tokenizer directory, so every later stage (trainer, HF engine, vLLM) loads it with
`AutoTokenizer.from_pretrained(path)` like any other model's tokenizer.

Every printable ASCII character is one token; `<pad>`, `<bos>`, `<eos>` and `<unk>` are the
special tokens (ids 0-3); encoding prepends `<bos>` like most HF tokenizers.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A fast tokenizer mapping each printable character to its own id."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    # Encoding with special tokens (the default) prepends <bos>, as for most HF tokenizers.
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
