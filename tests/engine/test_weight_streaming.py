"""Greedy tokens with decoder layers streamed from host memory or disk (PIPO) equal the tokens with
every layer resident: the embedded model and a random-weight preset, dense and INT4, Neo's
offloading off and on (its two-batch forward holds two layers at once), serially and on the
host-only testbed (whose GPU computes from buffers of its own, loaded by real copies and
real O_DIRECT reads). The budgets force the placement's tiers; the tests check the placement
took them and that bytes were streamed from each.
"""
import json
import os

import pytest

from engine import LLM, SamplingParams
from engine.weights import EMBEDDED_MODEL, create_loader
from scheduler.planning import TIER_GPU, TIER_DISK, TIER_HOST, WeightFormat, layer_image_bytes
from scheduler.planning.memory import resident_global_bytes
from scheduler.iteration_plan import PlanMode
from test_offload_generation import MAX_TOKENS as NEO_MAX_TOKENS
from test_offload_generation import PROMPTS as NEO_PROMPTS
from offload_costs import cost_tables
from test_offload_generation import SMALL_POOLS

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:", "Once upon a time,"]
MAX_TOKENS = 12
TWO_CORES = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2


def on_testbed(*values, slow: bool = False):
    """A parameter set for the testbed, skipped on fewer than 2 cores; `slow`: run by make test-slow."""
    marks = [pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores")]
    return pytest.param(*values, marks=[*marks, pytest.mark.slow] if slow else marks)




def tier_budgets(model: dict, tier: str) -> dict:
    """Flags forcing the tier(s): room on the GPU for embeddings, head, norms and 3 layer
    buffers (host, disk: every layer streams), or for 8 layers' worth with 8 more in host memory
    (mixed: some resident, some in host memory, the rest on disk)."""
    config = create_loader(model["model"], model.get("load_format", "auto")).config
    fmt = WeightFormat(model.get("quantization", "none"), 4)  # float32
    layer, globals_ = layer_image_bytes(config.shape, fmt), resident_global_bytes(config.shape, 4)
    if tier == "mixed":
        return dict(weights_gpu_gib=(globals_ + 8 * layer) / 2**30, weights_cpu_gib=8 * layer / 2**30)
    return dict(weight_placement={"host": "cpu", "disk": "disk"}[tier], weights_gpu_gib=(globals_ + 3 * layer) / 2**30)


# The offloading tests' cost tables (which make Neo's two-batch plans win often), every time scaled
# up so far that the transfers the streaming cost model adds from this machine's measured rates
# (a few milliseconds a layer) cannot change which plans win: the plans are the tables' alone.
COST_SCALE = 1000.0


def slow_cost_tables(tmp_path, num_layers: int) -> str:
    def scale(value):
        if isinstance(value, list):
            return [scale(v) for v in value]
        return value * COST_SCALE
    tables = cost_tables(num_layers)
    scaled = {key: value if key == "num_layers" else
              ([[x, y * COST_SCALE] for x, y in value] if isinstance(value, list) else
               {**value, "zs": scale(value["zs"])} if isinstance(value, dict) else value * COST_SCALE)
              for key, value in tables.items()}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(scaled))
    return str(path)


def workload(model: dict, cpu_attention: str) -> tuple[list, list]:
    """(prompts, sampling params). With offloading on, the offloading tests' 8 prompts of up to 48
    tokens: with their pools and cost tables the scheduler takes every path, batch-1 included."""
    prompts, max_tokens = (PROMPTS, [MAX_TOKENS] * len(PROMPTS)) if cpu_attention == "off" else (NEO_PROMPTS,
                                                                                                 NEO_MAX_TOKENS)
    if model.get("load_format") == "dummy":
        vocab = create_loader(model["model"], "dummy").config.vocab_size
        prompts = [[(7 * i + 13 * j) % vocab for j in range(4 + i % 6)] for i in range(len(prompts))]
    return prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]


def generate(llm: LLM, prompts, params) -> tuple[list, set]:
    """Token ids per prompt, and whether two-batch (pipelined) forwards with a batch-1 ran."""
    seen = set()
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        plan = schedule()
        if plan.mode == PlanMode.PIPELINED and plan.batch1_cpu_decodes:
            seen.add("batch-1")
        return plan

    scheduler.schedule = recording_schedule
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], seen


def run(model: dict, tmp_path, device="cpu", cpu_attention="off", tier=None, offload_dir=None) -> tuple[list, set]:
    kwargs = dict(model, device=device, cpu_attention=cpu_attention)
    if cpu_attention == "on":
        num_layers = create_loader(model["model"], model.get("load_format", "auto")).config.num_layers
        kwargs.update(SMALL_POOLS, cost_tables=slow_cost_tables(tmp_path, num_layers))
    if tier is not None:
        kwargs.update(tier_budgets(model, tier), offload_dir=str(offload_dir))
    with LLM(**kwargs) as llm:
        if tier is not None:
            check_placement(llm, tier, kwargs["weights_gpu_gib"])
        outputs, seen = generate(llm, *workload(model, cpu_attention))
        if tier is not None:
            stats = llm.engine.weight_stats
            streamed = set(llm.engine.plan.layers.placement.tiers) - {TIER_GPU}
            assert all(stats.bytes_by_tier[t] > 0 for t in streamed)
    return outputs, seen


def check_placement(llm: LLM, tier: str, weights_gpu_gib: float) -> None:
    tiers = set(llm.engine.runner.model.layer_store.tiers)
    expected = {"host": {TIER_HOST}, "disk": {TIER_DISK}, "mixed": {TIER_GPU, TIER_HOST, TIER_DISK}}[tier]
    assert tiers == expected, llm.engine.plan.layers.placement.tiers
    weight_bytes = llm.engine.runner.model.gpu_weight_bytes()
    assert weight_bytes <= weights_gpu_gib * 2**30  # the budget holds on the testbed too


EMBEDDED = dict(model=EMBEDDED_MODEL, dtype="float32", quantization="none")  # dense: the budgets bind
EMBEDDED_INT4 = dict(model=EMBEDDED_MODEL, dtype="float32", quantization="int4")
RANDOM = dict(model="smollm2-135m", load_format="dummy", dtype="float32")


@pytest.fixture(scope="module")
def offload_dir(tmp_path_factory):
    """One offload directory for the module: a conversion is reused across runs of one key."""
    return tmp_path_factory.mktemp("offload")


# Each factor (tier, device, Neo, format, model) is covered; not every combination, to keep the suite short.
@pytest.mark.parametrize("device, cpu_attention, tier", [
    ("cpu", "off", "host"), pytest.param("cpu", "on", "disk", marks=pytest.mark.slow),
    on_testbed("testbed", "on", "mixed"), on_testbed("testbed", "off", "disk", slow=True),  # mixed reads disk too
])
def test_embedded_model_streamed_equals_resident(references, offload_dir, tmp_path, device, cpu_attention, tier):
    outputs, seen = run(EMBEDDED, tmp_path, device, cpu_attention, tier, offload_dir)
    assert outputs == references(EMBEDDED, cpu_attention)
    if cpu_attention == "on":
        assert "batch-1" in seen  # two-batch forwards held two streamed layers at once


@pytest.mark.slow
def test_embedded_int4_streamed_equals_resident(references, offload_dir, tmp_path):
    """Q4_1 blocks kept packed (the CPU kernels' tiled copy in the image), in all three tiers,
    with Neo's two-batch forward; serial (device cpu): INT4 does not run on the testbed."""
    outputs, seen = run(EMBEDDED_INT4, tmp_path, "cpu", "on", "mixed", offload_dir)
    assert outputs == references(EMBEDDED_INT4, "on")
    assert "batch-1" in seen


@pytest.mark.parametrize("model, device, cpu_attention, tier", [
    (dict(RANDOM, quantization="int4"), "cpu", "off", "disk"),
    on_testbed(RANDOM, "testbed", "on", "host"),
])
def test_random_preset_streamed_equals_resident(references, offload_dir, tmp_path, model, device, cpu_attention, tier):
    outputs, seen = run(model, tmp_path, device, cpu_attention, tier, offload_dir)
    assert outputs == references(model, cpu_attention)
    if cpu_attention == "on":
        assert "batch-1" in seen
