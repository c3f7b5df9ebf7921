"""The planning stage decides once: `tandem plan --json` prints the plan a started engine holds,
field for field (the fit's predicted speeds aside: `tandem plan` measures them, the engine does not
need them, and predicting changes no choice)."""
import json

import pytest

from engine.engine import LLMEngine
from offload_costs import write_cost_tables
from server.cli import engine_config, main, parse_command_line

# (name, flags): the embedded model as served by default, then presets with random weights whose
# plans stream layers, slice MLPs and cache experts on the testbed (Neo's host pool beside them)
CASES = [
    ("embedded", []),
    ("streamed", ["--model", "smollm2-135m", "--load-format", "dummy", "--device", "testbed", "--dtype", "float32",
                  "--weights-gpu-gib", "0.3", "--max-model-len", "512"]),
    ("sliced", ["--model", "smollm2-135m", "--load-format", "dummy", "--device", "testbed", "--dtype", "float32",
                "--mlp-slicing", "0.25,0.5", "--max-model-len", "512"]),
    ("hot-experts", ["--model", "qwen3-moe-tiny", "--load-format", "dummy", "--device", "testbed",
                     "--dtype", "float32", "--hot-experts", "2", "--max-model-len", "512"]),
]


NUM_LAYERS = {"embedded": 30, "streamed": 30, "sliced": 30, "hot-experts": 2}


def decisions(plan: dict) -> dict:
    """The plan without the fit's predictions and the options it weighed for them."""
    fit = plan["fit"]
    if fit is not None:
        chosen = {key: value for key, value in fit["chosen"].items() if key != "prediction"}
        plan = {**plan, "fit": {"chosen": chosen, "reason": fit["reason"]}}
    return plan


@pytest.mark.parametrize("name, flags", CASES, ids=[name for name, _ in CASES])
def test_tandem_plan_prints_the_plan_the_engine_builds(name, flags, tmp_path, capsys):
    costs = write_cost_tables(tmp_path, NUM_LAYERS[name])
    # the session's profile cache (tests/conftest.py): the plan and the engine read the same profiles
    flags = [*flags, "--cost-tables", costs, "--max-num-seqs", "8", "--log-level", "warning"]
    assert main(["plan", "--json", *flags]) == 0
    printed = capsys.readouterr().out
    printed_plan = json.loads(printed[printed.index("\n{") + 1:])
    engine = LLMEngine(engine_config(parse_command_line(["plan", *flags], {})))
    try:
        assert decisions(printed_plan) == decisions(json.loads(json.dumps(engine.plan.to_dict())))
        expected = {"embedded": "gpu-only", "streamed": "neo", "sliced": "neo", "hot-experts": "neo"}[name]
        assert printed_plan["scheduler"]["kind"] == expected
    finally:
        engine.close()
    tiers = [layer["tier"] for layer in printed_plan["layers"]]
    if name == "streamed":
        assert "host" in tiers
    if name == "sliced":
        assert all(layer["rates"] == [0.25, 0.5, 0.25] for layer in printed_plan["layers"])
    if name == "hot-experts":
        assert printed_plan["hot_experts"]["num_slots"] == 2
