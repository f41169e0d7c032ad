"""cupy/CUDA kernels, imported only when a tensor is on a CUDA device and cupy is installed."""
