"""LM-Offload (issue 33): the performance model of a forward's overlapped tasks and the fit that
picks weight and KV formats, places layers and sizes both KV pools from two memory budgets.
Plain Python, no torch: `tandem plan` and the engine ask the same fit."""
from scheduler.planning.fit.model import AttentionCosts, KVCapacity, Prediction, predict
from scheduler.planning.fit.search import (
    MIN_LOSSY_GAIN,
    Configuration,
    Fit,
    FitBudgets,
    FitError,
    FitOption,
    FitProbes,
    FitRequest,
    FixedChoices,
    fit,
)

__all__ = ["AttentionCosts", "Configuration", "Fit", "FitBudgets", "FitError", "FitOption", "FitProbes", "FitRequest",
           "FixedChoices", "KVCapacity", "MIN_LOSSY_GAIN", "Prediction", "fit", "predict"]
