"""The GPU as the rest of the engine sees it: in-order work queues (inline on the CPU, a thread on
its own cores on the testbed, a CUDA stream) and which host cores each side runs on."""
