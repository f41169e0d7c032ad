"""The torch reference of every kernel: the executable spec the CPU and CUDA kernels match."""
