"""GPU kernels for kvgate codecs (torch reference + cupy/CUDA); filled in by the codecs work."""
