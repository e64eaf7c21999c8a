"""Decode-time token selectors; see base.py for the contract and sparsekv.registry for the list."""
