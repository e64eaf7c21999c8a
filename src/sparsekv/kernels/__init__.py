"""Hot ops of the sparse decode step. Each module exposes one function: a plain-PyTorch reference on CPU,
a Triton kernel on CUDA where one exists, with the same signature."""
