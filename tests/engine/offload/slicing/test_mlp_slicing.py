"""ScheInfer's MLP slicing (engine/offload/slicing/sliced_mlp.py, placed by engine/offload/layer_store.py): logits of a tiny random Llama with
every layer's MLP cut into CC, CG and GG parts match Hugging Face transformers to 1e-4 in fp32
for every placement (all GG, all CC, all CG, mixed rates, per-layer mixes), serially and on the
host-only testbed, dense and INT4; the CC part ran on the engine thread and the CG part was
copied; the parts' bytes are reported in their tiers. Prefill token assignment (CG'): with none,
some or all of a forward's tokens moved, logits still match, CC's weights were copied on a
transfer thread and computed on the GPU's, and the CPU saw only the remaining rows."""
import functools
import os
import threading

import pytest
import torch
import transformers

from engine.runtime import ModelRunner
from engine.device.cores import CoreAssignment
from engine.offload.layer_store import create_layer_store
from engine.offload.slicing.moved_part import MOVED_HOST_FORMAT
from engine.offload.slicing.sliced_mlp import SlicedMlp, slice_mlp
from engine.device.queues import WorkerThreadQueue
from engine.model.layers import fused_silu_mul
from engine.quant import create_linear_method
from engine.quant.dense import DenseWeight
from engine.quant.int4 import PackedInt4
from engine.weights import create_loader
from kernels.cpu import int4 as int4_kernels
from scheduler.planning import TIER_GPU, TIER_HOST
from scheduler.planning.layer_plan import ModelPlan
from scheduler.planning.slicing.moved_tokens import MovedTokens
from scheduler.planning.slicing.rates import SliceRates
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence

BLOCK_SIZE = 4
TOLERANCE = 1e-4
NUM_LAYERS = 3
TWO_CORES = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2
# intermediate 256 units: 8 INT4 groups, so every rate below cuts on group boundaries with units left
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            tie_word_embeddings=False, rope_theta=10000.0)

ALL_GG, ALL_CC, ALL_CG = SliceRates(0.0, 0.0, 1.0), SliceRates(1.0, 0.0, 0.0), SliceRates(0.0, 1.0, 0.0)
MIXED = SliceRates(0.25, 0.5, 0.25)
PLACEMENTS = {
    "all-gg": (ALL_GG,) * NUM_LAYERS,
    "all-cc": (ALL_CC,) * NUM_LAYERS,
    "all-cg": (ALL_CG,) * NUM_LAYERS,
    "mixed": (MIXED,) * NUM_LAYERS,
    "per-layer": (ALL_CC, SliceRates(0.0, 0.5, 0.5), SliceRates(0.25, 0.25, 0.5)),
}


def on_testbed(*values):
    return pytest.param(*values, marks=pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores"))


ON_CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**TINY), torch_dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # norms are ones at init: make them count
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model.save_pretrained(path, safe_serialization=True)
    return hf_model, str(path)


def create_sliced_layer_store(rates, placement, device, cores, **options):
    """The layer store of a plan slicing every resident layer's MLP at `rates` (one per layer)."""
    return create_layer_store(ModelPlan.compose(len(rates), placement, rates), device, cores, **options)


def sliced_runner(path: str, rates, device: str = "cpu", linear_method: str = "dense", layer_store=None,
                  **store_options) -> ModelRunner:
    loader = create_loader(path)
    if layer_store is None and rates is not None:
        layer_store = functools.partial(create_sliced_layer_store, rates, None, **store_options)
    return ModelRunner(loader.config, loader, dtype=torch.float32, device=device, num_blocks=64,
                       block_size=BLOCK_SIZE, max_model_len=128, linear_method=linear_method, layer_store=layer_store)


def steps(runner: ModelRunner, num_steps: int = 5):
    """Prefills of mixed lengths, then decodes with a late prefill among them: (tokens, logits) per
    scheduled row of each step, teacher-forced with random tokens."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=128))
    gen = torch.Generator().manual_seed(1)
    for i, n in enumerate([7, 1, 13]):
        sched.add_sequence(Sequence(str(i), torch.randint(0, 256, (n,), generator=gen).tolist(),
                                    SamplingParams(max_tokens=20)))
    for step in range(num_steps):
        if step == 2:
            sched.add_sequence(Sequence("late", torch.randint(0, 256, (9,), generator=gen).tolist(),
                                        SamplingParams(max_tokens=20)))
        plan = sched.schedule()
        logits = runner.compute_logits(plan)
        yield [(list(s.sequence.all_token_ids), logits[row]) for row, s in enumerate(plan.scheduled)]
        sched.update(plan, torch.randint(0, 256, (len(plan.scheduled),), generator=gen).tolist())


@torch.no_grad()
def hf_last_logits(hf_model, token_ids):
    return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


def sliced_store(runner: ModelRunner):
    return runner.model.layer_store


def check_the_parts_ran(runner: ModelRunner, rates, device: str) -> None:
    """CC computed on the engine thread (this one, which waits on the GPU's futures), never
    on the testbed's GPU thread; every layer with a CG part copied it in once per forward."""
    store = sliced_store(runner)
    num_forwards = 5
    cc_layers = sum(r.cc > 0 for r in rates)
    stats = store.stats
    assert stats.num_cc_calls == cc_layers * num_forwards
    if cc_layers:
        assert stats.cc_thread_ids == {threading.get_ident()}
    if device == "testbed":
        assert runner.gpu._thread.ident not in stats.cc_thread_ids
    cg_layers = [i for i, r in enumerate(rates) if r.cg > 0]
    if cg_layers:
        assert stats.num_loads >= len(cg_layers) * num_forwards
        cg_bytes = sum(store.ring.items[i].image.nbytes for i in cg_layers)
        assert stats.bytes_by_tier[TIER_HOST] >= cg_bytes * num_forwards
    else:
        assert not stats.streams
    assert runner.model.native is None  # the C++ whole-layer decoder never runs over sliced layers


def assert_steps_match_hf(runner, hf_model) -> None:
    """Every step's last-token logits equal transformers' for the same tokens."""
    for rows in steps(runner):
        for tokens, logits in rows:
            torch.testing.assert_close(logits.cpu(), hf_last_logits(hf_model, tokens), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("device", ["cpu", on_testbed("testbed"), ON_CUDA])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_sliced_logits_match_hf(tiny_model, placement, device):
    hf_model, path = tiny_model
    rates = PLACEMENTS[placement]
    runner = sliced_runner(path, rates, device)
    try:
        assert_steps_match_hf(runner, hf_model)
        check_the_parts_ran(runner, rates, device)
    finally:
        runner.close()


@pytest.mark.parametrize("placement", ["all-cc", "all-cg", "mixed", "per-layer"])
def test_sliced_int4_logits_match_the_resident_int4_model(tiny_model, placement):
    """INT4 cut on its groups of 32: every placement computes what the unsliced INT4 model does."""
    _, path = tiny_model
    rates = PLACEMENTS[placement]
    reference, runner = sliced_runner(path, None, linear_method="int4"), sliced_runner(path, rates, linear_method="int4")
    try:
        for expected, got in zip(steps(reference), steps(runner)):
            for (_, want), (_, logits) in zip(expected, got):
                torch.testing.assert_close(logits, want, atol=TOLERANCE, rtol=TOLERANCE)
        assert {part.format for layer in runner.model.layers for weight in layer.mlp.linear_weights()
                for part in weight.parts} == {"int4"}
        check_the_parts_ran(runner, rates, "cpu")
    finally:
        reference.close()
        runner.close()


def test_weight_bytes_put_cc_and_cg_in_host_memory(tiny_model):
    """Every parameter counted once: CC and CG parts as host bytes, GG, attention and globals as
    GPU bytes, and the ring CG passes through beside them."""
    hf_model, path = tiny_model
    runner = sliced_runner(path, (MIXED,) * NUM_LAYERS)
    try:
        model = runner.model
        bytes_by_tier = {}
        for (fmt, tier), nbytes in model.weight_bytes().items():
            if fmt != "layer buffers":
                bytes_by_tier[tier] = bytes_by_tier.get(tier, 0) + nbytes
        total = 4 * sum(p.numel() for p in hf_model.parameters())
        mlp_bytes = 4 * 3 * TINY["hidden_size"] * TINY["intermediate_size"]  # gate, up, down
        cc, cg, gg = MIXED.counts(TINY["intermediate_size"])
        host_bytes = NUM_LAYERS * mlp_bytes * (cc + cg) // TINY["intermediate_size"]
        assert bytes_by_tier == {TIER_HOST: host_bytes, TIER_GPU: total - host_bytes}
        layer = model.layers[0]
        assert isinstance(layer.mlp, SlicedMlp)
        assert tuple(layer.mlp.counts.values()) == (cc, cg, gg)
        assert model.weight_bytes()[("layer buffers", TIER_GPU)] > 0
    finally:
        runner.close()


def test_packed_int4_is_cut_on_its_groups():
    """gate/up rows and down's columns of a packed weight cut at group boundaries dequantize to the
    same numbers as the whole; a cut inside a group is refused."""
    gen = torch.Generator().manual_seed(3)
    packed = {name: PackedInt4(*int4_kernels.quantize_rtn(torch.randn(shape, generator=gen), 32), 32)
              for name, shape in (("gate_proj", (96, 64)), ("up_proj", (96, 64)), ("down_proj", (64, 96)))}
    slices = slice_mlp(packed, (32, 32, 32))
    whole = packed["down_proj"].dequantize()
    for index, name in enumerate(("cc", "cg", "gg")):
        torch.testing.assert_close(slices[name]["down"].dequantize(), whole[:, 32 * index:32 * (index + 1)],
                                   rtol=0, atol=0)
        gate_up = slices[name]["gate_up"].dequantize()
        torch.testing.assert_close(gate_up[:32], packed["gate_proj"].dequantize()[32 * index:32 * (index + 1)],
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match="groups of 32"):
        slice_mlp(packed, (16, 48, 32))


@pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores")
def test_the_testbed_runs_host_work_on_the_waiting_thread():
    """Work the GPU thread hands to the host runs on the thread that waits on the queue,
    while the GPU thread goes on with its own work."""
    queue = WorkerThreadQueue(None, 1)
    try:
        def gpu_work():
            host = queue.run_on_host(lambda: threading.get_ident())
            own = threading.get_ident()
            return own, host.result()

        gpu_id, host_id = queue.submit(gpu_work).result()
        assert host_id == threading.get_ident() != gpu_id

        def failing_host_work():
            return queue.run_on_host(lambda: 1 / 0).result()

        with pytest.raises(ZeroDivisionError):
            queue.submit(failing_host_work).result()
        queue.recover()
        assert queue.submit(lambda: 2).result() == 2
    finally:
        queue.close()


@pytest.mark.parametrize("device", ["cpu", on_testbed("testbed")])
def test_a_failed_cpu_part_fails_its_forward_and_the_next_one_computes(tiny_model, device):
    """CC's error (here a down weight of the wrong shape) reaches the forward that waits for it,
    on the GPU's side; the runner recovers and the next forward is right again."""
    hf_model, path = tiny_model
    runner = sliced_runner(path, (MIXED,) * NUM_LAYERS, device)
    try:
        mlp = sliced_store(runner).mlps[1]
        good = mlp.slices["cc"]["down"]
        mlp.slices["cc"]["down"] = DenseWeight(torch.zeros(TINY["hidden_size"], 3), None)
        forwards = steps(runner)
        with pytest.raises(RuntimeError):
            next(forwards)
        mlp.slices["cc"]["down"] = good
        for tokens, logits in next(steps(runner)):
            torch.testing.assert_close(logits, hf_last_logits(hf_model, tokens), atol=TOLERANCE, rtol=TOLERANCE)
    finally:
        runner.close()


def test_a_sliced_mlp_applies_its_cg_part_only_while_acquired(tiny_model):
    _, path = tiny_model
    runner = sliced_runner(path, (MIXED,) * NUM_LAYERS)
    try:
        mlp, store = runner.model.layers[0].mlp, sliced_store(runner)
        x = torch.randn(2, TINY["hidden_size"])
        with pytest.raises(RuntimeError, match="layer 0's weights are not on the GPU"):  # CG's
            mlp.apply(x, fused_silu_mul)
        store.acquire(0)
        assert mlp.apply(x, fused_silu_mul).shape == (2, TINY["hidden_size"])
        store.release(0)
    finally:
        runner.close()


@pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores")
def test_the_cpu_part_computes_on_the_cpu_sides_threads(tiny_model):
    """CC's INT4 kernels take the CPU side's thread count (the testbed's CPU cores), not the
    count calibrated for the whole machine; the streamed and resident parts keep theirs."""
    _, path = tiny_model
    cores = CoreAssignment.for_device("testbed")
    store = create_sliced_layer_store((MIXED,) * NUM_LAYERS, None, torch.device("cpu"), cores)
    try:
        loader = create_loader(path)
        store.build(0, loader.load_layer(0, torch.float32), create_linear_method("int4"), torch.float32)
        slices = store.mlps[0].slices
        assert {w.kernels.num_threads for w in slices["cc"].values()} == {cores.cpu_attention_threads}
        assert {w.kernels.num_threads for w in slices["gg"].values()} == {int4_kernels.default_num_threads()}
    finally:
        store.close()


# ---- prefill token assignment (CG') ----------------------------------------------------------
class ForcedMoves(MovedTokens):
    """Moves `share` of every forward's tokens (rounded down) in every layer, recording each ask."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.asked: list[tuple[int, int]] = []  # (layer, num_tokens)

    def count(self, layer: int, num_tokens: int) -> int:
        self.asked.append((layer, num_tokens))
        return int(num_tokens * self.share)


MOVED_SHARES = {"none": 0.0, "some": 0.5, "all": 1.0}
MOVING_RATES = PLACEMENTS["per-layer"]  # an all-CC layer, one without CC, a mixed one


def check_the_moves_ran(runner: ModelRunner, policy: ForcedMoves, device: str) -> None:
    """Only layers with a CC part asked; CG' computed the moved rows on the GPU's thread
    from weights the transfer thread copied, once per forward that moved any; the CPU computed the
    rest and only the rest."""
    store, stats = sliced_store(runner), sliced_store(runner).stats
    cc_layers = {i for i, r in enumerate(MOVING_RATES) if r.cc > 0}
    assert {layer for layer, _ in policy.asked} == cc_layers
    moved = [int(n * policy.share) for _, n in policy.asked]
    assert stats.num_moved_tokens == sum(moved)
    assert stats.num_cc_tokens == sum(n for _, n in policy.asked) - sum(moved)
    assert stats.num_cc_calls == sum(m < n for m, (_, n) in zip(moved, policy.asked))
    cc_bytes = {i: store.moved._host[i][0].nbytes for i in cc_layers}
    assert stats.moved_bytes == sum(cc_bytes[layer] for m, (layer, _) in zip(moved, policy.asked) if m)
    if not any(moved):
        assert not stats.moved_thread_ids and not stats.moved_copy_thread_ids
        return
    gpu = runner.gpu._thread.ident if device == "testbed" else threading.get_ident()
    assert stats.moved_thread_ids == {gpu}
    assert stats.moved_copy_thread_ids.isdisjoint({gpu, threading.get_ident()})
    assert store.moved.buffer_bytes == max(cc_bytes.values())  # one buffer, allocated at start


@pytest.mark.parametrize("device", ["cpu", on_testbed("testbed"), ON_CUDA])
@pytest.mark.parametrize("moved", sorted(MOVED_SHARES))
def test_moved_tokens_logits_match_hf(tiny_model, moved, device):
    hf_model, path = tiny_model
    policy = ForcedMoves(MOVED_SHARES[moved])
    runner = sliced_runner(path, MOVING_RATES, device, moved_tokens=policy)
    try:
        assert_steps_match_hf(runner, hf_model)
        check_the_moves_ran(runner, policy, device)
    finally:
        runner.close()


def test_moved_int4_tokens_match_the_resident_int4_model(tiny_model):
    _, path = tiny_model
    policy = ForcedMoves(0.5)
    reference = sliced_runner(path, None, linear_method="int4")
    runner = sliced_runner(path, MOVING_RATES, linear_method="int4", moved_tokens=policy)
    try:
        for expected, got in zip(steps(reference), steps(runner)):
            for (_, want), (_, logits) in zip(expected, got):
                torch.testing.assert_close(logits, want, atol=TOLERANCE, rtol=TOLERANCE)
        check_the_moves_ran(runner, policy, "cpu")
    finally:
        reference.close()
        runner.close()


def test_cc_weights_are_shared_with_cg_prime_on_the_host_or_copied_in_the_gpus_format(tiny_model):
    """On a host device the CPU part's weights are views into the image CG' copies from (no
    second host copy); where the formats differ (CUDA, here pretended on the CPU) a host copy in
    the GPU's format is kept, reported as host bytes, and computes the same logits."""
    hf_model, path = tiny_model
    shared = sliced_runner(path, MOVING_RATES, moved_tokens=ForcedMoves(0.5))

    def unshared_store(device, cores):
        store = create_sliced_layer_store(MOVING_RATES, None, device, cores, moved_tokens=ForcedMoves(0.5))
        store.moved.shares_host_bytes = False
        return store

    unshared = sliced_runner(path, MOVING_RATES, layer_store=unshared_store)
    try:
        store = sliced_store(shared)
        image, _, data = store.moved._host[0]
        cc_weight = store.mlps[0].slices["cc"]["gate_up"].tensors()["weight"]
        assert data.data_ptr() <= cc_weight.data_ptr() < data.data_ptr() + image.nbytes
        assert (MOVED_HOST_FORMAT, TIER_HOST) not in shared.model.weight_bytes()
        host_copies = sum(sliced_store(unshared).moved._host[i][0].nbytes for i in (0, 2))
        assert unshared.model.weight_bytes()[(MOVED_HOST_FORMAT, TIER_HOST)] == host_copies
        for rows in steps(unshared):
            for tokens, logits in rows:
                torch.testing.assert_close(logits, hf_last_logits(hf_model, tokens), atol=TOLERANCE, rtol=TOLERANCE)
    finally:
        shared.close()
        unshared.close()


class TooMany(MovedTokens):
    def count(self, layer: int, num_tokens: int) -> int:
        return num_tokens + 1


def test_a_policy_moving_more_tokens_than_there_are_fails_the_forward(tiny_model):
    _, path = tiny_model
    runner = sliced_runner(path, MOVING_RATES, moved_tokens=TooMany())
    try:
        with pytest.raises(ValueError, match="TooMany moved 22 of layer 0's 21 tokens"):
            next(steps(runner))
    finally:
        runner.close()


def test_without_room_for_cg_primes_buffer_every_token_stays_on_the_cpu(tiny_model, caplog):
    """A weight budget that holds everything but CG''s buffer: the store says so and moves nothing."""
    hf_model, path = tiny_model
    roomy = sliced_runner(path, MOVING_RATES, moved_tokens=ForcedMoves(0.5))
    store = sliced_store(roomy)
    budget = store.used_bytes - 1  # one byte short (the ring and CG''s buffer included)
    roomy.close()
    policy = ForcedMoves(0.5)
    runner = sliced_runner(path, MOVING_RATES, moved_tokens=policy, gpu_weight_budget_bytes=budget)
    try:
        store = sliced_store(runner)
        assert store.moved is None and "prefill token assignment off" in caplog.text
        for rows in steps(runner):
            for tokens, logits in rows:
                torch.testing.assert_close(logits, hf_last_logits(hf_model, tokens), atol=TOLERANCE, rtol=TOLERANCE)
        assert not policy.asked and store.stats.num_moved_tokens == 0 and not store.stats.moves
    finally:
        runner.close()


@pytest.mark.parametrize("moved", sorted(MOVED_SHARES))
def test_an_empty_sub_batch_passes_a_sliced_mlp(tiny_model, moved):
    """Neo's two-batch forward can hand a layer a sub-batch of no rows: [0, hidden] out."""
    _, path = tiny_model
    runner = sliced_runner(path, MOVING_RATES, moved_tokens=ForcedMoves(MOVED_SHARES[moved]))
    try:
        layer = runner.model.layers[0]  # all CC: nothing streamed to acquire
        assert layer.mlp.apply(torch.zeros(0, TINY["hidden_size"]), fused_silu_mul).shape == (0, TINY["hidden_size"])
    finally:
        runner.close()
