"""numba CPU kernels (``nogil``, split into chunks by ``gpu.dispatch.run_chunks``)."""
