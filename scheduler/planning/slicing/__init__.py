"""ScheInfer's slicing, decided: the CC/CG/GG rates of each MLP (rates.py), its cost models
(cost.py, model.py), the solvers (solver.py), the plan (plan.py) and prefill token moving. Plain
Python, no torch."""
