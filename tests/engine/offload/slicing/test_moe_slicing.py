"""MoE experts as ScheInfer's slicing units (engine/offload/slicing/moe_slicing.py): logits of the tiny
MoE families (Mixtral; Qwen3-MoE with a dense layer; Qwen2-MoE with a gated shared expert) with
whole experts CPU-computed (CC), streamed (CG) and resident (GG) match Hugging Face transformers
to 1e-4 in fp32 for every placement, over prefills and paged decodes, serially and on the
host-only testbed; the counters show CC computed on the engine thread only and each CG image
copied once per forward; experts' bytes are reported in their tiers; stores that cannot hold MoE
layers are refused with a reason."""
import functools
import threading
from dataclasses import dataclass

import pytest
import torch

from engine.runtime import ModelRunner
from engine.device.cores import CoreAssignment
from engine.offload.cpu_side import HostWeight
from engine.offload.layer_store import create_layer_store
from engine.offload.slicing.moe_slicing import SlicedSparseMoe
from engine.offload.ring import StreamedWeight
from scheduler.planning.layer_plan import ModelPlan
from scheduler.planning.slicing.rates import NUM_CG_BUFFERS
from engine.model_config import ConfigError
from engine.quant import create_linear_method
from engine.weights import create_loader
from scheduler.planning import TIER_GPU, TIER_HOST
from scheduler.planning.slicing.rates import SliceRates
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence
from test_weight_stream import placement
from test_mlp_slicing import ALL_CC, ALL_CG, ALL_GG, MIXED, TWO_CORES, create_sliced_layer_store
from tiny_moe import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, TOLERANCE, VOCAB_SIZE, build_tiny_moe

FAMILIES = ("mixtral", "qwen3-moe-dense-layer", "qwen2-moe-shared-expert")
NUM_LAYERS = 2  # every tiny family's
NUM_FORWARDS = 5
PLACEMENTS = {
    "all-gg": (ALL_GG,) * NUM_LAYERS,
    "all-cc": (ALL_CC,) * NUM_LAYERS,
    "all-cg": (ALL_CG,) * NUM_LAYERS,
    "mixed": (MIXED,) * NUM_LAYERS,
    # Qwen3's layer 1 is dense: 96 units, cut on 64-unit boundaries (64 CC, 32 GG)
    "per-layer": (SliceRates(0.25, 0.25, 0.5), SliceRates(0.5, 0.0, 0.5)),
}
ON_TESTBED = pytest.param("testbed", marks=pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores"))
ON_CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


@dataclass(eq=False)  # hashed by identity: hf_last_logits is memoized per model
class TinyMoe:
    hf_model: object
    path: str

    @functools.lru_cache(maxsize=None)
    @torch.no_grad()
    def hf_last_logits(self, token_ids: tuple[int, ...]) -> torch.Tensor:
        """HF's logits at the last of `token_ids`, computed once per sequence: every placement
        runs the same teacher-forced sequences."""
        return self.hf_model(torch.tensor([token_ids])).logits[0, -1].float()


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_moe(request, tmp_path_factory) -> TinyMoe:
    path = tmp_path_factory.mktemp(request.param)
    return TinyMoe(build_tiny_moe(request.param, path), str(path))


def sliced_runner(path: str, rates, device: str = "cpu", linear_method: str = "dense") -> ModelRunner:
    """The model's runner with its layers sliced at `rates` (None: every layer resident)."""
    loader = create_loader(path)
    store = None if rates is None else functools.partial(create_sliced_layer_store, rates, None)
    return ModelRunner(loader.config, loader, dtype=torch.float32, device=device, num_blocks=NUM_BLOCKS,
                       block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, linear_method=linear_method,
                       layer_store=store)


def steps(runner: ModelRunner):
    """Prefills of mixed lengths packed in one batch, then paged decodes with a late prefill
    joining: (tokens, logits) per scheduled row of each forward, teacher-forced with random tokens."""
    sched = Scheduler(SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN))
    gen = torch.Generator().manual_seed(1)

    def add(name: str, length: int) -> None:
        prompt = torch.randint(0, VOCAB_SIZE, (length,), generator=gen).tolist()
        sched.add_sequence(Sequence(name, prompt, SamplingParams(max_tokens=NUM_FORWARDS + 1)))

    for i, length in enumerate([7, 1, 13]):
        add(str(i), length)
    for step in range(NUM_FORWARDS):
        if step == 2:
            add("late", 9)
        plan = sched.schedule()
        logits = runner.compute_logits(plan)
        yield [(tuple(s.sequence.all_token_ids), logits[row]) for row, s in enumerate(plan.scheduled)]
        sched.update(plan, torch.randint(0, VOCAB_SIZE, (len(plan.scheduled),), generator=gen).tolist())


def check_the_parts_ran(runner: ModelRunner, rates, device: str) -> None:
    """CC (experts or dense units) computed on the engine thread, never on the testbed's
    GPU thread, at most once per layer and forward (a forward routing no token to a
    layer's CC experts skips it); each layer's CG image copied once per forward (the ring loads
    at most its buffers ahead)."""
    store = runner.model.layer_store
    stats = store.stats
    cc_layers = ([i for i, mlp in store.mlps.items() if mlp.counts["cc"]]
                 + [i for i, moe in store.moe_layers.items() if moe.num_cc])
    all_cc_layers = sum(rates[i] == ALL_CC for i in cc_layers)  # every token's every pair goes to the CPU
    assert all_cc_layers * NUM_FORWARDS <= stats.num_cc_calls <= len(cc_layers) * NUM_FORWARDS
    assert bool(stats.num_cc_calls) == bool(cc_layers)
    if cc_layers:
        assert stats.cc_thread_ids == {threading.get_ident()}
        assert stats.cc_s > 0
    if device == "testbed":
        assert runner.gpu._thread.ident not in stats.cc_thread_ids
    cg_layers = sorted(store.ring.items)
    assert bool(cg_layers) == any(r.cg for r in rates)
    transfers = store.stats
    if cg_layers:
        cg_bytes = sum(store.ring.items[i].image.nbytes for i in cg_layers)
        assert len(cg_layers) * NUM_FORWARDS <= transfers.num_loads <= len(cg_layers) * NUM_FORWARDS + NUM_CG_BUFFERS
        assert transfers.bytes_by_tier[TIER_HOST] >= cg_bytes * NUM_FORWARDS
    else:
        assert not transfers.streams


@pytest.mark.parametrize("device", ["cpu", ON_TESTBED, ON_CUDA])
@pytest.mark.parametrize("placement_name", sorted(PLACEMENTS))
def test_sliced_moe_logits_match_hf(tiny_moe, placement_name, device):
    rates = PLACEMENTS[placement_name]
    runner = sliced_runner(tiny_moe.path, rates, device)
    try:
        for rows in steps(runner):
            for tokens, logits in rows:
                torch.testing.assert_close(logits.cpu(), tiny_moe.hf_last_logits(tokens), atol=TOLERANCE,
                                           rtol=TOLERANCE)
        check_the_parts_ran(runner, rates, device)
    finally:
        runner.close()


@pytest.mark.parametrize("linear_method", ["dense", "int4"])
def test_sliced_experts_compute_exactly_what_resident_ones_do(tiny_moe, linear_method):
    """Each token's expert outputs are summed in expert order whichever tier computed them: with
    routed layers only, mixed rates give the resident model's logits bit for bit (INT4 too, its
    experts whole)."""
    config = create_loader(tiny_moe.path).config
    if config.moe.dense_layers:
        pytest.skip("a dense layer's slices sum CG, GG, CC: another order than the whole MLP's")
    if linear_method == "int4" and config.moe.expert_intermediate_size % 32:
        pytest.skip("expert width not a multiple of the INT4 group")
    resident = sliced_runner(tiny_moe.path, None, linear_method=linear_method)
    runner = sliced_runner(tiny_moe.path, (MIXED,) * NUM_LAYERS, linear_method=linear_method)
    try:
        for expected, got in zip(steps(resident), steps(runner)):
            for (_, want), (_, logits) in zip(expected, got):
                torch.testing.assert_close(logits, want, atol=0, rtol=0)
        assert runner.model.layer_store.stats.num_cc_calls > 0
    finally:
        resident.close()
        runner.close()


def test_experts_are_split_whole_in_expert_order(tiny_moe):
    """Mixed rates: experts [0, cc) on the host, [cc, cc + cg) streamed, the rest resident; the
    router and shared expert resident; a dense layer is sliced along units."""
    runner = sliced_runner(tiny_moe.path, (MIXED,) * NUM_LAYERS)
    try:
        moe_config = runner.model.config.moe
        num_cc, num_cg, num_gg = MIXED.counts(moe_config.num_experts)
        for index, layer in enumerate(runner.model.layers):
            if not moe_config.is_moe_layer(index):
                assert index in runner.model.layer_store.mlps
                continue
            mlp = layer.mlp
            assert isinstance(mlp, SlicedSparseMoe) and mlp.counts == {"cc": num_cc, "cg": num_cg, "gg": num_gg}
            kinds = [type(expert.gate_up) for expert in mlp.experts]
            assert kinds[:num_cc + num_cg] == [HostWeight] * num_cc + [StreamedWeight] * num_cg
            tiers = [expert.down.tier for expert in mlp.experts]
            assert tiers == [TIER_HOST] * (num_cc + num_cg) + [TIER_GPU] * num_gg
            resident = [mlp.router.gate, *([] if mlp.shared is None else mlp.shared.linear_weights())]
            assert {w.tier for w in resident} == {TIER_GPU}
    finally:
        runner.close()


def test_weight_bytes_put_cc_and_cg_experts_in_host_memory(tiny_moe):
    """Every parameter counted once: CC and CG experts (and a dense layer's CC and CG units) as
    host bytes, the rest as GPU bytes, the ring beside them."""
    runner = sliced_runner(tiny_moe.path, (MIXED,) * NUM_LAYERS)
    try:
        model, config = runner.model, runner.model.config
        bytes_by_tier = {}
        for (fmt, tier), nbytes in model.weight_bytes().items():
            if fmt != "layer buffers":
                bytes_by_tier[tier] = bytes_by_tier.get(tier, 0) + nbytes
        total = 4 * sum(p.numel() for p in tiny_moe.hf_model.parameters())
        moe = config.moe
        num_cc, num_cg, _ = MIXED.counts(moe.num_experts)
        expert_bytes = 4 * 3 * config.hidden_size * moe.expert_intermediate_size
        host_bytes = sum((num_cc + num_cg) * expert_bytes for i in range(NUM_LAYERS) if moe.is_moe_layer(i))
        for mlp in model.layer_store.mlps.values():  # dense layers: their CC and CG units
            host_bytes += 4 * 3 * config.hidden_size * (mlp.counts["cc"] + mlp.counts["cg"])
        assert bytes_by_tier == {TIER_HOST: host_bytes, TIER_GPU: total - host_bytes}
        assert model.weight_bytes()[("layer buffers", TIER_GPU)] > 0
    finally:
        runner.close()


def test_a_plan_streaming_a_moe_layer_whole_is_refused_with_a_reason(tiny_moe):
    loader = create_loader(tiny_moe.path)
    plan = ModelPlan.compose(NUM_LAYERS, placement((TIER_HOST,) + (TIER_GPU,) * (NUM_LAYERS - 1)))
    store = functools.partial(create_layer_store, plan, files=None, num_io_threads=1,
                              gpu_weight_budget_bytes=None, global_weight_bytes=0)
    with pytest.raises(ConfigError, match="layer 0 is placed for whole-layer streaming"):
        ModelRunner(loader.config, loader, dtype=torch.float32, device="cpu", num_blocks=NUM_BLOCKS,
                    block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, layer_store=store)


def test_slicing_refuses_a_moe_layer_placed_for_whole_layer_streaming(tiny_moe):
    loader = create_loader(tiny_moe.path)
    store = create_sliced_layer_store((MIXED,) * NUM_LAYERS, placement((TIER_HOST, TIER_GPU)),
                                      torch.device("cpu"), CoreAssignment.for_device("cpu"))
    try:
        with pytest.raises(ConfigError, match="layer 0 is placed for whole-layer streaming"):
            store.build_moe_layer(0, loader.load_layer(0, torch.float32), loader.config,
                                  create_linear_method("dense"), torch.float32)
    finally:
        store.close()

