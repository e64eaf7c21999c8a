"""Kernel and sparse-attention benchmarks (`sparsekv bench ...`). GPU only; every timing is a device-event median."""
