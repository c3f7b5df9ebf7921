"""tandem's compute kernels: kernels/cpu (C++, pybind11) and kernels/triton.

Importing this package before torch caps how long torch's OpenMP threads spin after each
parallel region (GOMP_SPINCOUNT, unless already set): the C++ kernels run on their own thread
pool, and torch's threads spinning on the same cores after an op (libgomp's default is 300000
spins, milliseconds) took them from the kernel that follows. On the 2-core VM the embedded model
decoded 1.6x faster single-stream and 3x faster at 32 streams under --quantization int4 with a
cap of 3000 spins, and as fast as before with dense weights (OMP_WAIT_POLICY=PASSIVE, no spin at
all, cost the dense path 25%).
"""
import os
import sys

TORCH_SPIN_COUNT = "3000"

# libgomp reads the variable once, as torch loads it: a process that imported torch first keeps the
# default spin (INT4 prefill chunks of 64 rows ran 2.3x slower so); the engine warns of it at start
SPIN_UNCAPPED = "torch" in sys.modules and "GOMP_SPINCOUNT" not in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", TORCH_SPIN_COUNT)
