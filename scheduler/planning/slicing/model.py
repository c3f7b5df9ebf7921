"""How long one sliced MLP (or MoE layer) takes: ScheInfer's four streams (sec. III-C, IV-A2),
from the linear cost models of slicing_cost.py. Plain Python, no torch.

The paper's equations 4-12 did not survive in our copy of the text; this is the model rebuilt
from its prose. Each of the layer's n GEMMs (gate/up then down; or each kind of a MoE layer's
expert GEMMs) is cut by the same rates into a CC, a CG and a GG part, and (in a prefill, sec.
IV-B) CC's weights may also go to the GPU as CG' with some of the tokens:

- Stream A, the CPU: the activations' hop to the CPU, then the CC parts GEMM by GEMM.
- Stream B, launches: one launch per copy (CG, CG') and per GPU GEMM (GG, CG, CG'),
  each taking `launch_s`; copies are launched first (so the link starts at once), then GG's,
  CG's and CG''s GEMMs. "A CG operation requires a launch to transfer data and a launch to
  execute GPU computation, so its coefficient is 2."
- Stream C, the link: the CG (then CG') weight slices GEMM by GEMM, each once its launch is done,
  and after the CPU finishes, the CC result's hop back (it queues behind the weight copies).
- Stream D, the GPU: the GG parts (they wait for nothing but their launches), then each
  CG and CG' part once its launch and its copy are done.

A part's time is its linear model's (slicing_cost.py) when the part is not empty and 0 when it is
(the paper's sign function). The layer's time is when the last stream is done: max(GPU,
CPU's result back). Volumes per part: a CPU GEMM of cc x the GEMM's multiply-adds (at the tokens
the CPU keeps) and cc x its weight bytes, GPU GEMMs of cg x / gg x them (CG' of cc x the
bytes, at the moved tokens), a copy of cg x the weight's bytes; a hop moves
tokens x hidden x dtype bytes. A MoE layer is sliced by whole experts, so a part's startup time
counts the GEMM calls it makes (rate x the experts its tokens use) instead of one, and its GEMMs
read the used experts' weights while its copy moves all of them; its GEMMs of a kind are one
group (all experts' gate/up, then all downs), a coarser order than the engine's expert by expert.

Every completion time is built from sums and maxima of such terms, so with the slice pattern (which
parts are empty) fixed and one unknown (the CC rate, or the number of moved tokens) it is a
maximum of functions linear in that unknown: `Pieces`. That is what makes the edge-point solver
(slicing_solver.py) exact.
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduler.planning.memory import WeightFormat
from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.slicing.cost import GemmCost, SlicingCosts

# A rate or token share at or below this is an empty part (floating-point solvers leave 1e-17s).
EMPTY_SHARE = 1e-12


@dataclass(frozen=True)
class Affine:
    """intercept + slope * x, x being the one unknown a solver varies."""

    intercept: float
    slope: float = 0.0

    def __add__(self, other: "Affine") -> "Affine":
        return Affine(self.intercept + other.intercept, self.slope + other.slope)

    def scale(self, factor: float) -> "Affine":
        return Affine(self.intercept * factor, self.slope * factor)

    def times(self, other: "Affine") -> "Affine":
        """The product, which stays linear because a solver varies one factor at a time."""
        if self.slope and other.slope:
            raise ValueError("times: both factors vary with the unknown; the product is not linear")
        return Affine(self.intercept * other.intercept,
                      self.slope * other.intercept + other.slope * self.intercept)

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


ZERO = Affine(0.0)


@dataclass(frozen=True)
class Pieces:
    """max over linear functions of x: a completion time that depends on which path was critical."""

    lines: tuple[Affine, ...]

    @classmethod
    def of(cls, line: Affine) -> "Pieces":
        return cls((line,))

    def plus(self, line: Affine) -> "Pieces":
        return Pieces(tuple(piece + line for piece in self.lines))

    def maximum(self, *others: "Pieces") -> "Pieces":
        """The maximum, keeping per slope only the highest line (the others never win)."""
        best: dict[float, Affine] = {}
        for pieces in (self, *others):
            for line in pieces.lines:
                if line.slope not in best or line.intercept > best[line.slope].intercept:
                    best[line.slope] = line
        return Pieces(tuple(best.values()))

    def at(self, x: float) -> float:
        return max(line.at(x) for line in self.lines)

    def crossings(self, low: float, high: float) -> list[float]:
        """Where two of the lines meet strictly inside (low, high): the only places, besides the
        ends, where the maximum can turn from falling to rising."""
        points = []
        for i, a in enumerate(self.lines):
            for b in self.lines[i + 1:]:
                if a.slope != b.slope:
                    x = (b.intercept - a.intercept) / (a.slope - b.slope)
                    if low < x < high:
                        points.append(x)
        return points


@dataclass(frozen=True)
class GemmWork:
    """One GEMM of an MLP at the layer's token count, or all of a MoE layer's expert GEMMs of one
    kind (gate/up or down) taken together."""

    multiply_adds: float  # tokens x out_features x in_features, summed over experts
    weight_bytes: int  # as stored (INT4: codes, scales and mins), summed over experts
    num_experts: int = 0  # 0: one GEMM cut by rows; else this many experts' GEMMs, cut by whole experts
    # of those, how many the tokens route to (expected): the GEMM calls made and the weights read
    # (a copy moves every expert of its part, used or not)
    num_active_experts: float = 0.0

    def __post_init__(self) -> None:
        if self.multiply_adds < 0 or self.weight_bytes < 0 or self.num_experts < 0:
            raise ValueError(f"multiply_adds={self.multiply_adds}, weight_bytes={self.weight_bytes} and "
                             f"num_experts={self.num_experts} must be >= 0")
        if not 0.0 <= self.num_active_experts <= self.num_experts:
            raise ValueError(f"num_active_experts={self.num_active_experts} must lie in [0, num_experts]")

    @property
    def read_bytes(self) -> float:
        """The weight bytes its GEMMs read: every expert's share of the used ones'."""
        if not self.num_experts:
            return float(self.weight_bytes)
        return self.weight_bytes * self.num_active_experts / self.num_experts


@dataclass(frozen=True)
class MlpWork:
    """One layer's sliced work at a token count: its GEMMs in order and the activations' hop."""

    gemms: tuple[GemmWork, ...]
    num_tokens: int
    hop_bytes: int  # num_tokens x hidden x dtype bytes: x to the CPU, and CC's result back

    def __post_init__(self) -> None:
        if not self.gemms:
            raise ValueError("gemms: a layer needs one or more GEMMs")
        if self.num_tokens < 1 or self.hop_bytes < 0:
            raise ValueError(f"num_tokens={self.num_tokens} must be >= 1 and hop_bytes={self.hop_bytes} >= 0")

    @property
    def weight_bytes(self) -> int:
        return sum(gemm.weight_bytes for gemm in self.gemms)

    @property
    def num_experts(self) -> int:
        """The experts a MoE layer is sliced by (rates are then multiples of 1 / num_experts), 0
        for an MLP cut by rows."""
        return self.gemms[0].num_experts


def dense_mlp_work(hidden_size: int, intermediate_size: int, num_tokens: int, fmt: WeightFormat) -> MlpWork:
    """A SwiGLU MLP: the fused gate/up [2I, H], then down [H, I]."""
    shapes = ((2 * intermediate_size, hidden_size), (hidden_size, intermediate_size))
    gemms = tuple(GemmWork(float(num_tokens) * out * inp, sum(fmt.linear_tensor_bytes(out, inp)))
                  for out, inp in shapes)
    return MlpWork(gemms, num_tokens, num_tokens * hidden_size * fmt.dtype_bytes)


def expected_active_experts(num_experts: int, num_experts_per_token: int, num_tokens: int) -> float:
    """How many distinct experts `num_tokens` tokens route to, each to `num_experts_per_token` of
    `num_experts`, taking each token's choice as uniform and independent: k at one token, every
    expert soon after."""
    return num_experts * (1.0 - (1.0 - num_experts_per_token / num_experts) ** num_tokens)


def moe_mlp_work(hidden_size: int, expert_intermediate_size: int, num_experts: int, num_experts_per_token: int,
                 num_tokens: int, fmt: WeightFormat) -> MlpWork:
    """A MoE layer's routed experts, each a SwiGLU MLP; every token visits `num_experts_per_token`
    of them, so the experts' GEMMs multiply num_tokens x top-k rows in all, in as many calls as
    experts are used (expected_active_experts), reading those experts' weights. Every expert of a
    streamed part is copied, used or not."""
    if not 1 <= num_experts_per_token <= num_experts:
        raise ValueError(f"num_experts_per_token={num_experts_per_token} must lie in [1, num_experts={num_experts}]")
    rows = float(num_tokens * num_experts_per_token)
    active = expected_active_experts(num_experts, num_experts_per_token, num_tokens)
    shapes = ((2 * expert_intermediate_size, hidden_size), (hidden_size, expert_intermediate_size))
    gemms = tuple(GemmWork(rows * out * inp, num_experts * sum(fmt.linear_tensor_bytes(out, inp)), num_experts,
                           active) for out, inp in shapes)
    return MlpWork(gemms, num_tokens, num_tokens * hidden_size * fmt.dtype_bytes)


@dataclass(frozen=True)
class SliceTerms:
    """The shares a layer's time depends on, each linear in the solver's unknown (or constant),
    and which parts are empty (fixed while a solver varies the unknown)."""

    cc: Affine
    cg: Affine
    gg: Affine
    moved_share: Affine  # of the tokens, those CG' computes on the GPU (prefill only)
    has_cc: bool  # the CPU computes something: CC weights and tokens left to it
    has_cg: bool
    has_gg: bool
    has_moved: bool  # CG' is copied and computed: CC weights and tokens moved

    @classmethod
    def at(cls, rates: SliceRates, moved_share: float = 0.0) -> "SliceTerms":
        """Constant terms and the pattern of one point."""
        has_cc = rates.cc > EMPTY_SHARE
        return cls(Affine(rates.cc), Affine(rates.cg), Affine(rates.gg), Affine(moved_share),
                   has_cc and moved_share < 1.0 - EMPTY_SHARE, rates.cg > EMPTY_SHARE, rates.gg > EMPTY_SHARE,
                   has_cc and moved_share > EMPTY_SHARE)

    @property
    def cpu_share(self) -> Affine:
        return Affine(1.0) + self.moved_share.scale(-1.0)


def _calls(gemm: GemmWork, rate: Affine, present: bool) -> Affine:
    """GEMM calls a part makes: one for a GEMM cut by rows, rate x the used experts for experts."""
    if not present:
        return ZERO
    return rate.scale(gemm.num_active_experts) if gemm.num_experts else Affine(1.0)


def _copies(present: bool) -> Affine:
    """Copies a streamed part makes per kind of GEMM: its slice is one block of its image, a MoE
    part's experts side by side."""
    return Affine(1.0) if present else ZERO


@dataclass(frozen=True)
class _Part:
    """A part the GPU computes: its name, its share of each weight and of the tokens."""

    name: str  # "gg", "cg" or "cgp" (CG')
    rate: Affine
    token_share: Affine
    present: bool


def _gpu_parts(terms: SliceTerms) -> list[_Part]:
    """In the GPU's order: resident work first, since it waits for no copy."""
    return [_Part("gg", terms.gg, Affine(1.0), terms.has_gg), _Part("cg", terms.cg, Affine(1.0), terms.has_cg),
            _Part("cgp", terms.cc, terms.moved_share, terms.has_moved)]


class _LaunchStream:
    """Stream B: launches one after the other; `issue` gives when the last of `calls` is done."""

    def __init__(self, launch_s: float) -> None:
        self.launch_s = launch_s
        self.num_launches = ZERO

    def issue(self, calls: Affine) -> Affine:
        self.num_launches = self.num_launches + calls
        return self.num_launches.scale(self.launch_s)


def _copy_s(gemm: GemmWork, costs: SlicingCosts, part: _Part) -> Affine:
    """One part's slice of a GEMM's weights over the link, alone."""
    return _copies(True).scale(costs.link.a_s) + part.rate.scale(costs.link.b_s_per_unit * gemm.weight_bytes)


Copies = tuple[dict[tuple[int, str], Pieces], Pieces, Affine]  # landed per (GEMM, part), link free, CPU time


def _link_stream(work: MlpWork, costs: SlicingCosts, terms: SliceTerms, copied: list[_Part],
                 launches: _LaunchStream) -> Copies:
    """Stream C: each GEMM's CG then CG' slice, once launched and once the link is free, slowed
    while GEMMs run beside it (GG's, or the CPU's). -> when each copy has landed, when the link
    is free again, and no CPU time (a copy engine of its own moves them)."""
    slowdown = costs.link_slowdown if terms.has_gg or terms.has_cc else 1.0
    launched = {(index, part.name): launches.issue(_copies(part.present))
                for index in range(len(work.gemms)) for part in copied}
    link_done, landed = Pieces.of(ZERO), {}
    for index, gemm in enumerate(work.gemms):
        for part in (part for part in copied if part.present):
            copy_s = _copy_s(gemm, costs, part).scale(slowdown)
            link_done = landed[index, part.name] = link_done.maximum(Pieces.of(launched[index, part.name])).plus(copy_s)
    return landed, link_done, ZERO


def _copies_on_cpu(work: MlpWork, costs: SlicingCosts, terms: SliceTerms, copied: list[_Part],
                   launches: _LaunchStream) -> Copies:
    """The link of the host-only testbed, whose copy engine is a thread on the CPU side's cores:
    copies take the CPU's time. The ring loads CG's slices for layers ahead, so at steady state
    a layer's CG keeps the GPU waiting for nothing but costs the CPU one layer's copies;
    CG' is copied as the MLP starts, before the CPU's own part, and the GPU waits for it.
    -> when each copy has landed, when the link is free (never queued before the result's hop),
    and the CPU time of the layer's copies."""
    landed, cgp_done, cpu_s = {}, ZERO, ZERO
    for index, gemm in enumerate(work.gemms):
        for part in copied:
            launched = launches.issue(_copies(part.present))
            if not part.present:
                continue
            copy_s = _copy_s(gemm, costs, part)
            cpu_s = cpu_s + copy_s
            if part.name == "cgp":
                cgp_done = cgp_done + copy_s
                landed[index, part.name] = Pieces.of(cgp_done).maximum(Pieces.of(launched))
            else:
                landed[index, part.name] = Pieces.of(launched)
    return landed, Pieces.of(ZERO), cpu_s


def _gemm_s(cost: GemmCost, gemm: GemmWork, calls: Affine, rate: Affine, token_share: Affine,
            slowdown: float) -> Affine:
    """A part's GEMM: its calls' startups, its multiply-adds (rate x tokens) and its weight bytes
    (rate), `slowdown` times longer for the other side computing beside it."""
    alone = calls.scale(cost.a_s) + rate.times(token_share).scale(cost.b_s_per_multiply_add * gemm.multiply_adds) + \
        rate.scale(cost.b_s_per_weight_byte * gemm.read_bytes)
    return alone.scale(slowdown)


def _gpu_stream(work: MlpWork, costs: SlicingCosts, terms: SliceTerms, parts: list[_Part],
                        launches: _LaunchStream, landed: dict[tuple[int, str], Pieces]) -> Pieces:
    """Stream D: each part's GEMMs in order, each once launched and (streamed parts) once copied;
    all of them slowed while the CPU computes its part, or copies on the testbed (the whole layer
    long: an upper bound)."""
    done = Pieces.of(ZERO)
    cpu_copies = costs.copies_on_cpu and (terms.has_cg or terms.has_moved)
    slowdown = costs.gpu_gemm_slowdown if terms.has_cc or cpu_copies else 1.0
    for part in (part for part in parts if part.present):
        for index, gemm in enumerate(work.gemms):
            calls = _calls(gemm, part.rate, True)
            ready = [Pieces.of(launches.issue(calls))] + ([landed[index, part.name]] if part.name != "gg" else [])
            done = done.maximum(*ready).plus(_gemm_s(costs.gpu_gemm, gemm, calls, part.rate, part.token_share,
                                                     slowdown))
    return done


def _hop_s(work: MlpWork, costs: SlicingCosts, terms: SliceTerms) -> Affine:
    """x's hop to the CPU, or the CC result's back: the CPU's share of the tokens' activations."""
    return Affine(costs.link.a_s) + terms.cpu_share.scale(costs.link.b_s_per_unit * work.hop_bytes)


def _cpu_done(work: MlpWork, costs: SlicingCosts, terms: SliceTerms, copies_s: Affine = ZERO) -> Affine:
    """Stream A: the hand-over to the CPU with x's hop, the copies that take the CPU's time (the
    testbed's) and the CC GEMMs (slowed while the GPU computes too)."""
    slowdown = costs.cpu_gemm_slowdown if terms.has_cg or terms.has_gg or terms.has_moved else 1.0
    cpu_done = Affine(costs.handoff_s) + _hop_s(work, costs, terms) + copies_s
    for gemm in work.gemms:
        cpu_done = cpu_done + _gemm_s(costs.cpu_gemm, gemm, _calls(gemm, terms.cc, True), terms.cc, terms.cpu_share,
                                      slowdown)
    return cpu_done


def _cpu_result_back(work: MlpWork, costs: SlicingCosts, terms: SliceTerms, link_done: Pieces,
                     copies_s: Affine) -> Pieces:
    """Stream A, then C: the CPU's part, then the result's hop back once the link has landed the
    weight slices queued before it."""
    return Pieces.of(_cpu_done(work, costs, terms, copies_s)).maximum(link_done).plus(_hop_s(work, costs, terms))


def layer_pieces(work: MlpWork, costs: SlicingCosts, terms: SliceTerms) -> Pieces:
    """The layer's time as a maximum of linear functions of the unknown in `terms`: when the
    GPU's last GEMM and the CC result's hop back are both done."""
    parts = _gpu_parts(terms)
    launches = _LaunchStream(costs.launch_s)
    link = _copies_on_cpu if costs.copies_on_cpu else _link_stream
    landed, link_done, copies_s = link(work, costs, terms, [part for part in parts if part.name != "gg"], launches)
    gpu_done = _gpu_stream(work, costs, terms, parts, launches, landed)
    if not terms.has_cc:
        return gpu_done.maximum(Pieces.of(copies_s))
    return gpu_done.maximum(_cpu_result_back(work, costs, terms, link_done, copies_s))


def layer_time_s(work: MlpWork, costs: SlicingCosts, rates: SliceRates, num_moved_tokens: int = 0) -> float:
    """The layer's predicted time at these rates, `num_moved_tokens` of its tokens computed with CG'."""
    if not 0 <= num_moved_tokens <= work.num_tokens:
        raise ValueError(f"num_moved_tokens={num_moved_tokens} must lie in [0, num_tokens={work.num_tokens}]")
    terms = SliceTerms.at(rates, num_moved_tokens / work.num_tokens)
    return layer_pieces(work, costs, terms).at(0.0)


def cpu_time_s(work: MlpWork, costs: SlicingCosts, rates: SliceRates) -> float:
    """How long the CPU is busy with the layer's MLP at these rates (x's hop and the CC GEMMs, and
    on the testbed the copies; the result's hop back waits on the link, not the CPU): what Neo's
    scheduler charges to the CPU's time line beside its decode attention."""
    terms = SliceTerms.at(rates)
    copies_s = ZERO
    if costs.copies_on_cpu:
        launches = _LaunchStream(costs.launch_s)
        copied = [part for part in _gpu_parts(terms) if part.name != "gg"]
        copies_s = _copies_on_cpu(work, costs, terms, copied, launches)[2]
    if not terms.has_cc:
        return copies_s.at(0.0)
    return _cpu_done(work, costs, terms, copies_s).at(0.0)
