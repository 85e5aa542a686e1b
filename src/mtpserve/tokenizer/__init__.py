"""Tokenizer from GGUF metadata, token-exact with llama.cpp: text <-> ids.

Sits at the bottom next to `gguf/` (imports only `mtpserve.gguf`): `vocab.py` reads the vocabulary with
llama.cpp's rules, `backend.py` builds the Rust `tokenizers` model from it, `tokenizer.py` encodes and
decodes, `detokenize.py` streams text. Chat templates, reasoning and tool calls live in `mtpserve.chat`.
"""

from .detokenize import IncrementalDetokenizer
from .tokenizer import Tokenizer
from .vocab import Vocab, load_vocab

__all__ = ["IncrementalDetokenizer", "Tokenizer", "Vocab", "load_vocab"]
