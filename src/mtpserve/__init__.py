"""mtpserve: a Python inference server for GGUF language models, with MTP speculative decoding."""

__version__ = "0.1.0"
