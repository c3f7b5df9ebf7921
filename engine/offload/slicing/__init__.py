"""ScheInfer's slicing as it runs: an MLP's units (or a MoE layer's experts) split between the CPU
(CC), host memory streamed to the GPU (CG) and the GPU (GG), and prefill tokens moved to CG'."""
