"""What needs a CUDA device (`make bench-gpu`): a decode step's host and GPU time, Neo offloading on a
real GPU."""
