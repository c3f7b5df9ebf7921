"""Kernels alone against their references and the machine's bandwidth: CPU paged attention, the INT4
matmuls on CPU and on CUDA (Triton), and the accuracy the quantized formats keep."""
