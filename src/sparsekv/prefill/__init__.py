"""Prefill methods: they rewrite or evict the prompt before decoding (GemFilter, ...)."""
