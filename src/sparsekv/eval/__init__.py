"""Offline evaluation harness: perplexity, needle in a haystack, RULER-style tasks, retrieval IoU, fidelity."""
