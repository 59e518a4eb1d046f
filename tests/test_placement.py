"""Tests for converter.placement: exactness against brute force, promote
constraints, shared casts, the greedy baseline and validation."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from networkx.algorithms.flow import edmonds_karp, preflow_push

from converter.passes.place.baselines import solve_greedy_tf
from converter.passes.place.solver import (
    FP32,
    HALF,
    PlacementProblem,
    Tensor,
    is_feasible,
    reference_labels,
    satisfies_invariant,
    solve_mincut,
    total_cost,
)
from tests.placement_oracles import solve_exhaustive

COSTS = (0, 1, 1, 2, 3, 4, 4, 8, 16)


def _random_problem(rng: random.Random, *, max_choosable: int = 14) -> PlacementProblem:
    """A random DAG: nodes in a random topological order, each producing 0-2
    tensors read by later nodes (duplicates and self-consumers sprinkled in),
    plus fixed sink consumers."""
    n_choosable = rng.randint(0, max_choosable)
    n_promote = rng.randint(0, n_choosable)
    n_fixed = rng.randint(0, 6)
    free = [f"f{i}" for i in range(n_choosable - n_promote)]
    promote = [f"p{i}" for i in range(n_promote)]
    fixed = {f"x{i}": rng.choice((HALF, FP32)) for i in range(n_fixed)}
    order = free + promote + list(fixed)
    rng.shuffle(order)
    sinks = {f"sink{i}": rng.choice((HALF, FP32)) for i in range(rng.randint(0, 2))}
    fixed.update(sinks)
    tensors = []
    for pos, producer in enumerate(order):
        later = order[pos + 1 :]
        for _ in range(rng.choice((0, 1, 1, 1, 2))):
            fan = rng.choice((1, 1, 2, 2, 3, 4))
            pool = later + list(sinks) if rng.random() < 0.2 else later
            if not pool:
                continue
            consumers = [rng.choice(pool) for _ in range(fan)]
            if rng.random() < 0.1:
                consumers.append(producer)  # ignored self-consumer
            if rng.random() < 0.1 and consumers:
                consumers.append(consumers[0])  # duplicate
            tensors.append(Tensor(producer, rng.choice(COSTS), tuple(consumers)))
    return PlacementProblem(fixed=fixed, free=free, promote=promote, tensors=tensors)


def _n_fp32(labels) -> int:
    return sum(1 for v in labels.values() if v == FP32)


def _check_against_exhaustive(problem: PlacementProblem, *, invariant: bool = True) -> None:
    ref = solve_exhaustive(problem, invariant=invariant)
    for kwargs in ({"invariant": invariant}, {"small_region": 0, "invariant": invariant}):
        got = solve_mincut(problem, **kwargs)
        if invariant:  # checked by direct simulation, not by the encoding
            assert satisfies_invariant(problem, got.labels), kwargs
        assert set(got.labels) == set(problem.free) | set(problem.promote)
        assert got.cost == ref.cost, kwargs
        assert total_cost(problem, got.labels) == got.cost
        assert is_feasible(problem, got.labels)  # promote constraint
        # tie-break towards half: as few fp32 nodes as the best exhaustive optimum
        assert _n_fp32(got.labels) == _n_fp32(ref.labels), kwargs
        # optimal fp32 sets are closed under intersection, so that optimum is unique
        assert dict(got.labels) == dict(ref.labels), kwargs
        assert dict(got.alternative_cost) == dict(ref.alternative_cost), kwargs
    assert total_cost(problem, ref.labels) == ref.cost
    assert is_feasible(problem, ref.labels)
    greedy = solve_greedy_tf(problem)  # the baseline is feasible, and never better
    assert is_feasible(problem, greedy.labels) and greedy.cost >= ref.cost


@pytest.mark.parametrize("seed", range(200))
def test_mincut_is_optimal_random_dags(seed: int) -> None:
    _check_against_exhaustive(_random_problem(random.Random(seed)))


@pytest.mark.parametrize("seed", range(0, 200, 2))
def test_bytes_mode_is_optimal_random_dags(seed: int) -> None:
    _check_against_exhaustive(_random_problem(random.Random(seed)), invariant=False)


def _rounding_problem(rng: random.Random) -> PlacementProblem:
    """A random DAG shaped like a transformer's cast sites: fixed fp32 producers
    (norms, softmax), fixed half ones (matmuls), follow chains between them and
    promote sums, with small equal-ish costs so that ties are common."""
    kinds = [rng.choice(("fp32", "half", "free", "free", "free", "promote")) for _ in range(rng.randint(4, 16))]
    kinds[0] = "fp32"
    names = [f"{k[0]}{i}" for i, k in enumerate(kinds)]
    fixed = {n: (FP32 if k == "fp32" else HALF) for n, k in zip(names, kinds) if k in ("fp32", "half")}
    fixed["out"] = FP32
    free = [n for n, k in zip(names, kinds) if k == "free"]
    promote = [n for n, k in zip(names, kinds) if k == "promote"]
    tensors = []
    for pos, producer in enumerate(names):
        later = names[pos + 1 :] or ["out"]
        consumers = rng.sample(later, min(len(later), rng.choice((1, 2, 2, 3))))
        tensors.append(Tensor(producer, rng.choice((2, 2, 4)), tuple(consumers)))
    return PlacementProblem(fixed=fixed, free=free, promote=promote, tensors=tensors)


@pytest.mark.parametrize("seed", range(150))
def test_invariant_is_optimal_transformer_like_dags(seed: int) -> None:
    problem = _rounding_problem(random.Random(seed))
    _check_against_exhaustive(problem)
    _check_against_exhaustive(problem, invariant=False)


def test_invariant_bites_on_random_dags() -> None:
    """The random problems exercise the invariant: in many of them the byte
    optimum rounds a guarded value, and keeping the invariant costs bytes in some;
    per-consumer casting (the reference) always keeps it and never costs less."""
    violated = dearer = 0
    for seed in range(150):
        problem = _rounding_problem(random.Random(seed))
        cheap = solve_mincut(problem, invariant=False)
        safe = solve_mincut(problem)
        reference = reference_labels(problem)
        assert satisfies_invariant(problem, reference) and is_feasible(problem, reference)
        assert cheap.cost <= safe.cost <= total_cost(problem, reference)
        violated += not satisfies_invariant(problem, cheap.labels)
        dearer += safe.cost > cheap.cost
    print(f"byte optimum breaks the invariant in {violated}/150, the invariant costs bytes in {dearer}/150")
    assert violated >= 30 and dearer >= 10, (violated, dearer)


@st.composite
def _problems(draw) -> PlacementProblem:
    n_free = draw(st.integers(0, 7))
    n_promote = draw(st.integers(0, 7))
    n_fixed = draw(st.integers(0, 4))
    free = [f"f{i}" for i in range(n_free)]
    promote = [f"p{i}" for i in range(n_promote)]
    fixed = {f"x{i}": draw(st.sampled_from((HALF, FP32))) for i in range(n_fixed)}
    order = draw(st.permutations(free + promote + list(fixed)))
    tensors = []
    for pos, producer in enumerate(order):
        later = order[pos + 1 :]
        if not later:
            continue
        for _ in range(draw(st.integers(0, 2))):
            consumers = draw(st.lists(st.sampled_from(later), min_size=1, max_size=4))
            cost = draw(st.sampled_from(COSTS))
            tensors.append(Tensor(producer, cost, tuple(consumers)))
    return PlacementProblem(fixed=fixed, free=free, promote=promote, tensors=tensors)


@settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(_problems(), st.booleans())
def test_mincut_is_optimal_hypothesis(problem: PlacementProblem, invariant: bool) -> None:
    _check_against_exhaustive(problem, invariant=invariant)


@pytest.mark.parametrize("flow_func", [edmonds_karp, preflow_push])
def test_other_flow_functions(flow_func) -> None:
    for seed in range(1000, 1020):
        problem = _random_problem(random.Random(seed), max_choosable=10)
        ref = solve_exhaustive(problem)
        got = solve_mincut(problem, small_region=0, flow_func=flow_func)
        assert got.cost == ref.cost
        assert _n_fp32(got.labels) == _n_fp32(ref.labels)
        assert dict(got.alternative_cost) == dict(ref.alternative_cost)


def test_beats_greedy_painting() -> None:
    # A wide fp32 tensor is sliced (free) before a half matmul.  Greedy painting
    # spreads half backwards through the clear slice and casts the wide tensor;
    # the optimum keeps the slice fp32 and casts its narrow output.
    #   embed(fp32) --4 MiB--> slice(free) --64 KiB--> matmul(half)
    #   layer_norm(fp32) --1 MiB--> view(free) --1 MiB--> transpose(free) --> bmm(half)
    problem = PlacementProblem(
        fixed={"embed": FP32, "matmul": HALF, "layer_norm": FP32, "bmm": HALF, "out": FP32},
        free=["slice", "view", "transpose"],
        tensors=[
            Tensor("embed", 4 << 20, ("slice",)),
            Tensor("slice", 64 << 10, ("matmul",)),
            Tensor("layer_norm", 1 << 20, ("view",)),
            Tensor("view", 1 << 20, ("transpose",)),
            Tensor("transpose", 1 << 20, ("bmm",)),
            Tensor("matmul", 64 << 10, ("out",)),
        ],
    )
    greedy = solve_greedy_tf(problem)
    best = solve_mincut(problem)
    print(f"\ngreedy TF painting: {greedy.cost} bytes {dict(greedy.labels)}")
    print(f"min-cut placement:  {best.cost} bytes {dict(best.labels)}")
    assert best.cost < greedy.cost
    assert best.cost == solve_exhaustive(problem).cost
    assert best.labels["slice"] == FP32 and greedy.labels["slice"] == HALF
    assert best.alternative_cost["slice"] == (4 << 20) - (64 << 10)


def test_greedy_replays_tf_simple_case() -> None:
    # Exp -> Relu -> Sqrt -> Relu -> MatMul -> Relu -> Log -> Relu -> Other -> Relu
    chain = ["exp", "relu1", "sqrt", "relu2", "matmul", "relu3", "log", "relu4", "other", "relu5"]
    problem = PlacementProblem(
        fixed={"exp": FP32, "matmul": HALF, "other": FP32},
        free=["relu1", "relu2", "relu3", "relu4", "relu5"],
        promote=["sqrt", "log"],
        tensors=[Tensor(a, 1, (b,)) for a, b in zip(chain, chain[1:])],
    )
    greedy = solve_greedy_tf(problem)
    half = {n for n, v in greedy.labels.items() if v == HALF}
    assert half == {"relu2", "relu3"}
    assert greedy.cost == 2
    assert solve_mincut(problem).cost == 2
    assert is_feasible(problem, greedy.labels)


def test_shared_cast_counts_once() -> None:
    consumers = ("a", "b", "c")
    problem = PlacementProblem(
        fixed={"src": FP32, "ha": HALF, "hb": HALF, "hc": HALF},
        free=list(consumers),
        tensors=[Tensor("src", 100, consumers)]
        + [Tensor(c, 1000, ("h" + c,)) for c in consumers],
    )
    for kwargs in ({}, {"small_region": 0}):
        result = solve_mincut(problem, **kwargs)
        assert dict(result.labels) == {c: HALF for c in consumers}
        assert result.cost == 100  # one cast of src, shared by a, b and c
        assert result.regions == 1  # linked through the shared cast
    assert total_cost(problem, {"a": HALF, "b": HALF, "c": FP32}) == 1100


def test_tie_breaks_towards_half() -> None:
    # Either label costs one 5-byte cast: half wins.
    problem = PlacementProblem(
        fixed={"mm": HALF, "ln": FP32},
        free=["x"],
        tensors=[Tensor("mm", 5, ("x",)), Tensor("x", 5, ("ln",))],
    )
    for kwargs in ({}, {"small_region": 0}):
        result = solve_mincut(problem, **kwargs)
        assert result.labels == {"x": HALF} and result.cost == 5
        assert result.alternative_cost == {"x": 0}


def test_promote_forced_by_fixed_fp32_input() -> None:
    problem = PlacementProblem(
        fixed={"mask": FP32, "mm": HALF, "mm2": HALF},
        free=[],
        promote=["add", "add2"],
        tensors=[
            Tensor("mask", 0, ("add",)),
            Tensor("mm", 10, ("add",)),
            Tensor("add", 10, ("add2", "mm2")),
            Tensor("mm", 10, ("add2",)),
        ],
    )
    for kwargs in ({}, {"small_region": 0}):
        result = solve_mincut(problem, **kwargs)
        assert result.labels == {"add": FP32, "add2": FP32}
        assert result.cost == 30
        assert "add" not in result.alternative_cost  # half is infeasible
        assert "add2" not in result.alternative_cost


def test_constants_zero_costs_and_isolated_nodes() -> None:
    problem = PlacementProblem(
        fixed={"a": HALF, "b": FP32, "c": HALF},
        free=["lonely", "z"],
        tensors=[
            Tensor("a", 7, ("b", "c", "a")),  # all fixed: constant 7
            Tensor("b", 0, ("z",)),  # free of cost
            Tensor("z", 3, ("z", "z")),  # only itself: nothing to cast
        ],
    )
    result = solve_mincut(problem)
    assert result.cost == 7
    assert result.labels == {"lonely": HALF, "z": HALF}
    assert result.regions == 2
    assert result.alternative_cost == {"lonely": 0, "z": 0}
    assert solve_exhaustive(problem).cost == 7


def test_empty_problem_and_no_alternatives() -> None:
    empty = solve_mincut(PlacementProblem(fixed={}, free=[]))
    assert empty.cost == 0 and empty.regions == 0 and not empty.labels
    problem = _random_problem(random.Random(7))
    assert solve_mincut(problem, alternatives=False).alternative_cost == {}


def test_regions_decompose_and_large_region_is_exact() -> None:
    # 300 independent copies of a 6-node region; every region alike.
    fixed, free, promote, tensors = {}, [], [], []
    for i in range(300):
        fixed.update({f"ln{i}": FP32, f"q{i}": HALF, f"sm{i}": FP32, f"o{i}": HALF})
        free += [f"v{i}", f"t{i}", f"s{i}", f"d{i}"]
        promote += [f"m{i}", f"r{i}"]
        tensors += [
            Tensor(f"q{i}", 40, (f"v{i}",)),
            Tensor(f"v{i}", 40, (f"t{i}", f"r{i}")),
            Tensor(f"t{i}", 40, (f"m{i}",)),
            Tensor(f"ln{i}", 20, (f"m{i}",)),
            Tensor(f"m{i}", 40, (f"s{i}", f"sm{i}")),
            Tensor(f"s{i}", 40, (f"d{i}",)),
            Tensor(f"d{i}", 40, (f"o{i}", f"r{i}")),
            Tensor(f"r{i}", 40 + i % 3, (f"sm{i}",)),
        ]
    problem = PlacementProblem(fixed=fixed, free=free, promote=promote, tensors=tensors)
    result = solve_mincut(problem)
    assert result.regions == 300
    one = PlacementProblem(
        fixed={k: v for k, v in fixed.items() if k.endswith("0") and k[-2:-1].isalpha()},
        free=free[:4],
        promote=promote[:2],
        tensors=tensors[:8],
    )
    ref = solve_exhaustive(one)
    got_alt = {n: result.alternative_cost[n] for n in ref.alternative_cost}
    assert got_alt == dict(ref.alternative_cost)
    assert {n: result.labels[n] for n in ref.labels} == dict(ref.labels)
    per_region = [
        total_cost(
            PlacementProblem(
                fixed=fixed, free=free[4 * i : 4 * i + 4], promote=promote[2 * i : 2 * i + 2],
                tensors=tensors[8 * i : 8 * i + 8],
            ),
            {n: result.labels[n] for n in free[4 * i : 4 * i + 4] + promote[2 * i : 2 * i + 2]},
        )
        for i in range(300)
    ]
    assert sum(per_region) == result.cost

    # One long chain region (a residual stream from a half embedding): min-cut with
    # dynamic alternatives must agree with re-solving each flip from scratch.
    chain = _chain_problem(random.Random(3), 60, embed=HALF)
    got = solve_mincut(chain, alternative_budget=None)  # 120 nodes: exact without a budget
    assert got.regions == 1
    budgeted = solve_mincut(chain)  # what the budget lets through is exact
    assert dict(budgeted.labels) == dict(got.labels) and budgeted.cost == got.cost
    assert all(got.alternative_cost[n] == d for n, d in budgeted.alternative_cost.items())
    assert total_cost(chain, got.labels) == got.cost
    assert is_feasible(chain, got.labels)
    big = 10**9  # pin a node with a huge-cost edge from a fixed node, keeping its constraints
    for node in list(chain.free)[::5] + list(chain.promote)[::5]:
        flipped = FP32 if got.labels[node] == HALF else HALF
        pinned = PlacementProblem(
            fixed={**chain.fixed, "pin": flipped},
            free=chain.free,
            promote=chain.promote,
            tensors=(*chain.tensors, Tensor("pin", big, (node,))),
        )
        sub = solve_mincut(pinned, alternatives=False, small_region=0)
        if sub.cost >= big:
            assert node not in got.alternative_cost
            continue
        assert got.alternative_cost[node] == sub.cost - got.cost, node


def test_fp32_input_forces_promote_chain() -> None:
    # An fp32 embedding forces the whole promote residual stream to fp32; what is
    # left splits into one region per dropout.
    chain = _chain_problem(random.Random(3), 60, embed=FP32)
    got = solve_mincut(chain)
    assert got.regions == 60
    assert all(got.labels[q] == FP32 for q in chain.promote)
    assert not set(chain.promote) & set(got.alternative_cost)
    assert set(got.alternative_cost) == set(chain.free)
    whole = solve_mincut(chain, small_region=0)
    assert whole.cost == got.cost and dict(whole.labels) == dict(got.labels)


def _chain_problem(rng: random.Random, layers: int, *, embed: str) -> PlacementProblem:
    fixed = {"emb": embed}
    free, promote, tensors = [], [], []
    stream = "emb"
    for i in range(layers):
        fixed.update({f"ln{i}": FP32, f"fc{i}": HALF})
        free.append(f"drop{i}")
        promote.append(f"add{i}")
        tensors += [
            Tensor(stream, rng.choice((4, 8)), (f"ln{i}", f"add{i}")),
            Tensor(f"ln{i}", 4, (f"fc{i}",)),
            Tensor(f"fc{i}", rng.choice((2, 4, 6)), (f"drop{i}",)),
            Tensor(f"drop{i}", rng.choice((2, 4, 6)), (f"add{i}",)),
        ]
        stream = f"add{i}"
    fixed["out"] = FP32
    tensors.append(Tensor(stream, 4, ("out",)))
    return PlacementProblem(fixed=fixed, free=free, promote=promote, tensors=tensors)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: PlacementProblem(fixed={"a": "fp16"}, free=[]), "unknown label"),
        (lambda: PlacementProblem(fixed={"a": HALF}, free=["a"]), "more than once"),
        (lambda: PlacementProblem(fixed={}, free=["a"], promote=["a"]), "more than once"),
        (lambda: PlacementProblem(fixed={}, free=["a", "a"]), "more than once"),
        (lambda: PlacementProblem(fixed={}, free=["a"], tensors=[Tensor("b", 1, ["a"])]), "produc"),
        (lambda: PlacementProblem(fixed={}, free=["a"], tensors=[Tensor("a", 1, ["b"])]), "consum"),
        (lambda: Tensor("a", -1, ("b",)), ">= 0"),
        (lambda: Tensor("a", 1.5, ("b",)), "must be an int"),
        (lambda: Tensor("a", True, ("b",)), "must be an int"),
        (lambda: Tensor("a", 1, "b"), "sequence of node names"),
    ],
)
def test_invalid_problems_raise(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_invalid_labellings_raise() -> None:
    problem = PlacementProblem(fixed={"a": HALF}, free=["b"], tensors=[Tensor("a", 1, ("b",))])
    with pytest.raises(ValueError, match="misses"):
        total_cost(problem, {})
    with pytest.raises(ValueError, match="unknown label"):
        total_cost(problem, {"b": "bf16"})
    with pytest.raises(ValueError, match="fixed node"):
        total_cost(problem, {"a": FP32, "b": HALF})
    with pytest.raises(ValueError, match="unknown node"):
        total_cost(problem, {"b": HALF, "zz": HALF})
    with pytest.raises(ValueError, match="max_nodes"):
        solve_exhaustive(PlacementProblem(fixed={}, free=[f"n{i}" for i in range(5)]), max_nodes=4)
    with pytest.raises(ValueError, match="small_region"):
        solve_mincut(problem, small_region=-1)


# --------------------------------------------------------------------------- #
# The invariant on converted graphs: casts and dtypes counted exactly
# --------------------------------------------------------------------------- #
class _NormBranch(torch.nn.Module):
    """LayerNorm -> {dropout | view | identity} -> {linear, residual add}."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.1)
        self.ident = torch.nn.Identity()
        self.kind = kind

    def forward(self, x):
        h = self.ln(x)
        if self.kind == "dropout":
            h = self.drop(h)
        elif self.kind == "view":
            h = h.view(h.shape)
        else:
            h = self.ident(h)
        return self.fc(h) + h


def _run_recorded(module, *args):
    from helpers import DtypeRecorder

    from converter.numerics.measure import count_casts

    rec = DtypeRecorder()
    torch.manual_seed(0)
    with torch.no_grad(), rec:
        module(*args)
    return count_casts(module, args), rec


@pytest.mark.parametrize("kind", ["dropout", "view", "identity"])
@pytest.mark.parametrize("train", [False, True])
def test_norm_follow_branch_keeps_residual_fp32(kind: str, train: bool) -> None:
    import converter

    torch.manual_seed(0)
    model = _NormBranch(kind).train(train)
    x = torch.randn(2, 4, 16)
    act_bytes = 2 * 4 * 16 * (4 + 2)  # one fp32 -> bf16 activation cast
    for placement in ("mincut", "simple"):
        conv = converter.convert(model, (x,), placement=placement)
        precisions = {n: d.precision for n, d in conv.decisions.items()}
        follow = [n for n in precisions if n.startswith(("drop", "view"))]
        assert all(precisions[n] == "fp32" for n in follow), (placement, precisions)
        assert precisions["add"] == "fp32", (placement, precisions)
        casts, rec = _run_recorded(conv.module, x)
        assert casts["casts"] == 1 and casts["cast_bytes"] == act_bytes, (placement, casts)
        assert casts["weight_casts"] == 2, casts
        assert rec.dtypes_of("add") == [(torch.float32, torch.bfloat16)] or rec.dtypes_of("add") == [
            (torch.bfloat16, torch.float32)
        ], rec.dtypes_of("add")
        assert rec.dtypes_of("native_layer_norm") == [(torch.float32,) * 3]
    if kind != "identity":  # identity vanishes at capture: nothing for bytes-only placement to move
        cheap = converter.convert(model, (x,), placement="mincut-bytes")
        precisions = {n: d.precision for n, d in cheap.decisions.items()}
        assert precisions["add"] == "bf16", precisions  # the documented risk: the residual is rounded
        casts, rec = _run_recorded(cheap.module, x)
        assert casts["casts"] == 2 and casts["cast_bytes"] == 2 * act_bytes, casts  # and back for the output


class _ScoreChain(torch.nn.Module):
    """A follow chain (scale, transpose) feeding an fp32 softmax and a half matmul."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)
        self.source = source

    def forward(self, x, y):
        h = self.ln(x) if self.source == "ln" else x @ y
        h = (h * 0.5).transpose(-1, -2)
        return torch.softmax(h, -1) + h @ y


@pytest.mark.parametrize("placement", ["mincut", "mincut-bytes", "simple"])
def test_follow_chain_feeding_softmax_and_matmul(placement: str) -> None:
    import converter

    x, y = torch.randn(2, 8, 8), torch.randn(8, 8)
    # from an fp32 LayerNorm: the chain stays fp32, one cast of its output for the matmul (+ y)
    conv = converter.convert(_ScoreChain("ln"), (x, y), placement=placement)
    precisions = {n: d.precision for n, d in conv.decisions.items()}
    assert (precisions["mul"], precisions["transpose"], precisions["add"]) == ("fp32", "fp32", "fp32"), precisions
    casts, rec = _run_recorded(conv.module, x, y)
    assert (casts["casts"], casts["cast_bytes"]) == (2, 128 * 6 + 64 * 6), casts
    assert rec.dtypes_of("_softmax") == [(torch.float32,)]
    assert rec.dtypes_of("mul", "transpose") == [(torch.float32,), (torch.float32,)]
    # from a half matmul: the chain runs in half as under autocast; one up-cast for the softmax
    conv = converter.convert(_ScoreChain("mm"), (x, y), placement=placement)
    precisions = {n: d.precision for n, d in conv.decisions.items()}
    assert (precisions["mul"], precisions["transpose"]) == ("bf16", "bf16"), precisions
    casts, rec = _run_recorded(conv.module, x, y)
    assert (casts["casts"], casts["cast_bytes"]) == (3, 128 * 6 + 64 * 6 + 128 * 6), casts
    assert rec.dtypes_of("_softmax") == [(torch.float32,)]
    assert rec.dtypes_of("mul", "transpose") == [(torch.bfloat16,), (torch.bfloat16,)]


# --------------------------------------------------------------------------- #
# Scoped module rules: a norm rule pins the norm's own ops, not a block's
# --------------------------------------------------------------------------- #
class _Attention(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1) @ v)


class EncoderLayerStableLayerNorm(torch.nn.Module):
    """Shaped like HF's pre-norm encoder layers whose class name ends in "LayerNorm"
    (``Wav2Vec2EncoderLayerStableLayerNorm``): norms, attention and feed-forward are
    child modules; the layer runs its residual adds itself."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.layer_norm = torch.nn.LayerNorm(d)
        self.attention = _Attention(d)
        self.final_layer_norm = torch.nn.LayerNorm(d)
        self.feed_forward = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.ReLU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attention(self.layer_norm(x))
        return x + self.feed_forward(self.final_layer_norm(x))


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([EncoderLayerStableLayerNorm() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_norm_rule_does_not_pin_a_block_named_layernorm() -> None:
    import converter

    torch.manual_seed(0)
    model, x = _Stack().eval(), torch.randn(2, 8, 32)
    conv = converter.convert(model, (x,))
    rows = {r["name"]: r for r in conv.report.nodes}
    linears = [r for r in rows.values() if r["op"] in ("linear", "matmul")]
    assert len(linears) == 12, len(linears)
    assert all(r["precision"] == "bf16" for r in linears), [(r["name"], r["rule"]) for r in linears if r["precision"] != "bf16"]
    norms = [r for r in rows.values() if r["op"] == "layer_norm"]
    assert len(norms) == 4 and all(r["precision"] == "fp32" and r["rule_level"] == "module_type" for r in norms)
    assert conv.report.summary["half_flop_fraction"] >= 0.9, conv.report.summary
    assert conv.report.summary["warnings"] == []
    # the old subtree scope is still there for who asks for it, and then the report warns
    conv = converter.convert(model, (x,), rules=[_rules_file({"EncoderLayerStableLayerNorm": "subtree"})])
    summary = conv.report.summary
    assert summary["half_flop_fraction"] == 0.0, summary
    [warning] = summary["warnings"]
    assert warning["kind"] == "module_rule_pins_flops" and "EncoderLayerStableLayerNorm" in warning["rule"]
    assert warning["share"] > 0.95 and "warning: module rule" in conv.report.line


def _rules_file(scopes: dict) -> str:
    import tempfile

    lines = ["[module_type]"] + [f'"{name}" = {{ precision = "fp32", scope = "{scope}" }}' for name, scope in scopes.items()]
    handle = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    handle.write("\n".join(lines) + "\n")
    handle.close()
    return handle.name


def test_rule_scope_is_validated_and_defaults_to_self_for_norms() -> None:
    from converter.rules.loader import Rules, RulesError

    rules = Rules.from_dict({"module_type": {"*LayerNorm": "fp32", "Block": "fp32", "*RMSNorm": {"precision": "fp32", "scope": "subtree"}},
                             "module": {"*.norm1": "fp32", "*.attn": {"precision": "fp32", "ops": {"linear": "half"}},
                                        "ln_f": {"precision": "fp32", "reason": "final normalisation"},
                                        "ln_g": {"precision": "fp32", "reason": "norm", "scope": "self"}}})
    scopes = {(r.pattern, r.op): r.scope for r in rules.rules}
    assert scopes == {("*LayerNorm", ""): "self", ("Block", ""): "subtree", ("*RMSNorm", ""): "subtree",
                      ("*.norm1", ""): "self", ("*.attn", "linear"): "subtree", ("*.attn", ""): "subtree",
                      ("ln_f", ""): "subtree", ("ln_g", ""): "self"}  # a reason is prose: it never sets the scope
    stack = (("", "Model"), ("block", "Block"), ("block.ln", "LayerNorm"))
    assert [m.scope for m in rules.matches_for(node="n", op="layer_norm", module_stack=stack)] == ["block.ln", "block"]
    child = rules.matches_for(node="n", op="linear", module_stack=(("", "Model"), ("x", "FooLayerNorm"), ("x.fc", "Linear")))
    assert child == []  # the self-scoped norm rule does not reach the child's linear
    for body, fragment in [
        ({"module_type": {"Block": {"precision": "fp32", "scope": "all"}}}, "scope: must be \"self\""),
        ({"op": {"linear": {"precision": "half", "scope": "self"}}}, "unknown key"),
        ({"module": {"a": {"precision": "fp32", "ops": {"linear": {"precision": "half", "scope": "self"}}}}}, "unknown key"),
    ]:
        with pytest.raises(RulesError, match=fragment):
            Rules.from_dict(body)


# --------------------------------------------------------------------------- #
# fp16 overflow at convert time
# --------------------------------------------------------------------------- #
_OVERFLOW_MODEL = '''
import torch
from torch import nn


class Big(nn.Module):
    """fc's outputs reach ~1.5e5 on the example: finite in fp32, inf in fp16 (max 65504)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.fc.weight.mul_(5000.0)

    def forward(self, x):
        return self.head(self.ln(self.fc(x)))


def build_model():
    torch.manual_seed(0)
    return Big()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(2, 8) * 20,)


def calibration_inputs():
    return [example_inputs() for _ in range(2)]
'''


def _overflow_model():
    namespace: dict = {}
    exec(compile(_OVERFLOW_MODEL, "overflow_model", "exec"), namespace)  # noqa: S102 - test fixture
    return namespace["build_model"](), namespace["example_inputs"]()


def test_fp16_overflow_is_caught_at_convert_time(one_thread) -> None:
    import converter
    from converter.api import Fp16OverflowError

    model, example = _overflow_model()
    with torch.no_grad():
        peak = float(model.fc(example[0]).abs().max())
        assert torch.isfinite(model(*example)).all() and peak > 65504, peak
    with pytest.raises(Fp16OverflowError, match=r"node 'fc' \(op linear, module 'fc'\).*calibration=.*--calibrate.*bf16") as err:
        converter.convert(model, example, precision="fp16")
    assert err.value.node == "fc" and err.value.exit_code == 1
    # bf16 has fp32's range; calibration re-decides fc; a report-only audit never runs the model
    for conv in (converter.convert(model, example, precision="bf16"),
                 converter.convert(model, example, precision="fp16", calibration=[example])):
        assert torch.isfinite(conv.module(*example)).all(), conv.precision
    assert converter.audit(model, example, precision="fp16").summary["compute_nodes"] >= 3


def test_cli_exits_1_on_fp16_overflow(tmp_path) -> None:
    import subprocess
    import sys

    model_file = tmp_path / "big.py"
    model_file.write_text(_OVERFLOW_MODEL)
    out = tmp_path / "big_mp"
    proc = subprocess.run([sys.executable, "-m", "converter", str(model_file), "--precision", "fp16", "--out", str(out),
                           "--no-measure", "--device-profile", "none"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "fp16 overflow: node 'fc'" in lines[0] and "--calibrate" in lines[0], proc.stderr
    assert "report" not in lines[0].lower().replace("reports", ""), lines[0]  # never "please report this bug"
    assert not out.exists()


def test_native_promotion_reads_the_shared_cast() -> None:
    """GPT-2's tanh GELU: pow is fp32, so the chain after it stays fp32 and x is cast up once; the
    promoting add reads that same cast (one conversion per (producer, dtype)) rather than promoting
    x natively a second time."""
    import converter

    class Gelu(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            g = 0.5 * h * (1.0 + torch.tanh(0.79788 * (h + 0.044715 * torch.pow(h, 3.0))))
            return self.out(g)

    torch.manual_seed(0)
    model, x = Gelu(), torch.randn(4, 8)
    conv = converter.convert(model, (x,))
    add = next(n for n in conv.module.graph.nodes if n.name == "add")
    assert [a.name for a in add.all_input_nodes] == ["fc_to_fp32", "mul_1"], add.all_input_nodes
    record = add.args[0].meta["mp_cast"]
    assert "add" in record.consumers and record.src == "fc"
    casts, _ = _run_recorded(conv.module, x)
    # x -> bf16, fc -> fp32 (shared by pow, add and nothing else), 1 + tanh -> bf16 for the last
    # multiply (its value reaches only the half linear), the output back to fp32
    assert casts["casts"] == 4, casts
    with torch.no_grad():
        assert torch.allclose(conv.module(x), model(x), atol=0.05)
