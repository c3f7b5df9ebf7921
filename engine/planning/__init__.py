"""The engine's side of planning: this machine's measurements (engine/profiling) and an
EngineConfig turned into the inputs of the torch-free planners (scheduler/planning)."""
