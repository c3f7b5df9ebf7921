"""The parts that keep weights off the GPU, composed per layer by the plan: the layer store that
builds them (layer_store.py), the buffer ring and its copy engines (PIPO), the CPU side, sliced MLPs
(slicing/, ScheInfer), the hot-expert cache (experts/), and the layer files of the disk tier."""
