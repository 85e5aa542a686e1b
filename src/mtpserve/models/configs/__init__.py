"""Each architecture's config from GGUF metadata, without PyTorch."""
