"""A MoE model's experts, decided: which keep a GPU slot (hot_experts.py) and where a forward's
routed experts compute (split.py). Plain Python, no torch."""
