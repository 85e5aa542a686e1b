"""Tokenizer and chat templates from GGUF metadata, token-exact with llama.cpp.

Sits at the bottom next to `gguf/` (imports only `mtpserve.gguf`): `vocab.py` reads the vocabulary with
llama.cpp's rules, `backend.py` builds the Rust `tokenizers` model from it, `tokenizer.py` encodes and
decodes, `detokenize.py` streams text, `chat_template.py` renders prompts, `reasoning.py` splits
`<think>` output into reasoning and content.
"""

from .chat_template import CHATML_TEMPLATE, ChatPrompt, ChatTemplate, ChatTemplateError, resolve_chat_template
from .detokenize import IncrementalDetokenizer
from .reasoning import ReasoningSplit, ReasoningStream, ThinkTags, split_reasoning
from .tokenizer import Tokenizer
from .vocab import Vocab, load_vocab

__all__ = [
    "CHATML_TEMPLATE",
    "ChatPrompt",
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "ReasoningSplit",
    "ReasoningStream",
    "ThinkTags",
    "Tokenizer",
    "Vocab",
    "load_vocab",
    "resolve_chat_template",
    "split_reasoning",
]
