"""Turning a model into results: generation loops, perplexity, and (later) the slot scheduler."""
