"""FlexShard on real gloo process groups, against the single-process model and optimizer.

One spawned group per world size runs every check (initialisation, forward and
backward, the optimizer step and its communication) and returns what the
parent compares with an unsharded reference computed here.
"""

from __future__ import annotations

import pytest
import torch

from europa.core.config import load_config
from europa.core.model import build_moe_model, materialise
from europa.core.optim import MuonWithAdamW
from europa.spec.optim import uses_muon

pytestmark = pytest.mark.distributed

SEED = 3
STEPS = 2
BATCH, SEQ = 4, 16


def _config():
    return load_config("tiny", ["model.n_layers=3", "model.dim=64", "model.num_experts=6"])


def _tokens():
    vocab = _config().model.vocab_size
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _seeded_grads(names_and_shapes, step):
    g = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=g) for name, shape in names_and_shapes}


def _laid_out_model(experts=None, **groups):
    from europa.core.model import MatrixInitialiser, init_buffers
    from europa.flexshard import flex_shard

    model = build_moe_model(_config().model)
    init_matrix = MatrixInitialiser(model, SEED)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    layout = flex_shard(model, experts=experts, **groups)
    layout.materialise("cpu", init_matrix)
    init_buffers(model, torch.device("cpu"))
    return model, layout, shapes


def _flexshard_rank(rank: int, world: int) -> dict:
    model, layout, _ = _laid_out_model()
    initial = layout.full_parameters()

    # Forward and backward on this rank's quarter of the batch: averaged gradients.
    tokens = _tokens().chunk(world)[rank]
    _loss(model, tokens).backward()
    local_grads = {n: p.grad.clone() for n, p in layout.named_local_parameters()}
    norm = layout.clip_grad_norm_(0.0)
    from europa.flexshard.experts import ExpertParallel

    # 6 experts a layer split over every rank: the layers' runs differ when uneven.
    _, expert_layout, _ = _laid_out_model(experts=ExpertParallel())
    return {
        "sums_in_backward": _sums_in_backward(rank, world) if world == 4 else None,
        "mean_and_sum": _mean_and_sum_over_ranks(rank, world) if world == 2 else None,
        "initial_expert_parallel": expert_layout.full_parameters(),
        "initial": initial,
        "local_grads": local_grads,
        "ranges": dict(layout.plan.ranges),
        "norm": norm,
        "optimizers": {a: _optimizer_steps(a) for a in ("muon", "adamw")},
    }


def _sums_in_backward(rank: int, world: int) -> dict:
    """Two copies of a 2-rank layout (replicas {0, 2} and {1, 3}) and of its experts,
    two micro-batches: the once-a-step sums issued in the last backward against after it."""
    import torch.distributed as dist

    from europa.flexshard.errors import PlanError
    from europa.flexshard.experts import ExpertParallel
    from europa.spec.tags import traffic_kind

    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    shard, replicate = shards[rank // 2], replicas[rank % 2]
    mine = _tokens()[rank : rank + 1]
    micro = (mine[:, : SEQ // 2 + 1], mine[:, SEQ // 2 :])  # two halves of its sequence
    out = {}
    original, original_send, calls, scatters, phase = dist.all_reduce, dist.isend, [], [], ["setup"]

    def counted(*args, **kwargs):
        calls.append(phase[0])
        return original(*args, **kwargs)

    def counted_send(tensor, *args, **kwargs):
        # gloo's reduce-scatters are direct transfers, tagged as what they stand for
        if traffic_kind(tensor) == "gradient_reduce_scatter":
            scatters.append(phase[0])
        return original_send(tensor, *args, **kwargs)

    for in_backward in (0, 2):
        experts = ExpertParallel(group=shard, copies=replicate, data_parallel_size=world)
        model, layout, _ = _laid_out_model(experts, group=shard, replicate_group=replicate)
        layout.sum_copies_in_backward(in_backward)
        calls.clear()
        scatters.clear()
        dist.all_reduce, dist.isend = counted, counted_send
        try:
            for phase[0], tokens in zip(("first backward", "last backward"), micro, strict=True):
                (_loss(model, tokens) / 2).backward()
            phase[0] = "finish_gradients"
            layout.finish_gradients()
        finally:
            dist.all_reduce, dist.isend = original, original_send
        grads = {n: p.grad.clone() for n, p in layout.named_local_parameters()}
        refused = ""
        if in_backward:
            for _ in range(3):  # a third backward before finish_gradients
                try:
                    _loss(model, micro[0]).backward()
                except PlanError as error:
                    refused = str(error)
                    break
        out[in_backward] = {
            "grads": grads,
            "all_reduces": list(calls),
            "reduce_scatters": list(scatters),
            "refused": refused,
        }
    return out


def _mean_and_sum_over_ranks(rank: int, world: int) -> dict:
    """This rank's gradients after one backward on its own tokens, averaged and summed over
    the ranks (``mean_over_ranks``): experts resident over the world, and each rank
    holding the whole model as a replica of the other (no shard group)."""
    import torch.distributed as dist

    from europa.flexshard.experts import ExpertParallel

    alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])
    layouts = {
        "experts": lambda mean: _laid_out_model(ExpertParallel(), mean_over_ranks=mean),
        "replicas": lambda mean: _laid_out_model(
            group=alone, replicate_group=dist.group.WORLD, mean_over_ranks=mean
        ),
    }
    out = {}
    for kind, lay_out in layouts.items():
        for mean in (True, False):
            model, layout, _ = lay_out(mean)
            _loss(model, _tokens().chunk(world)[rank]).backward()
            layout.finish_gradients()
            out[kind, mean] = {n: p.grad.clone() for n, p in layout.named_local_parameters()}
    return out


def _optimizer_steps(algorithm: str) -> dict:
    """The optimizer on prescribed full gradients: each rank's owned slices of them."""
    from torch.distributed.tensor.debug import CommDebugMode

    from europa.flexshard import FlexShardOptimizer

    _, layout, shapes = _laid_out_model()
    optimizer = FlexShardOptimizer(layout, lr=0.02, algorithm=algorithm, weight_decay=0.1)
    collectives = []
    for step in range(STEPS):
        grads = _seeded_grads(shapes, step)
        for name, param in layout.named_local_parameters():
            spec, owned = layout.plan.spec(name), layout.owned_indices(name)
            full = grads[name] if spec.stacked else grads[name].unsqueeze(0)
            param.grad = full[owned.start : owned.stop].clone()
        with CommDebugMode() as comm:
            optimizer.step()
        collectives.append(comm.get_total_counts())
    return {"collectives_in_step": collectives, "after": layout.full_parameters()}


def _reference_model():
    model = build_moe_model(_config().model)
    materialise(model, torch.device("cpu"), SEED)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    _loss(model, _tokens()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return initial, grads


def _reference_steps(algorithm: str) -> dict[str, torch.Tensor]:
    model = build_moe_model(_config().model)
    materialise(model, torch.device("cpu"), SEED)
    named = list(model.named_parameters())
    if algorithm == "muon":
        optimizer = MuonWithAdamW(
            [p for n, p in named if uses_muon(n, p.shape)],
            [p for n, p in named if not uses_muon(n, p.shape)],
            lr=0.02,
            weight_decay=0.1,
        )
    else:
        optimizer = MuonWithAdamW([], [p for _, p in named], lr=0.02, weight_decay=0.1)
    shapes = [(n, tuple(p.shape)) for n, p in named]
    for step in range(STEPS):
        seeded = _seeded_grads(shapes, step)
        for name, param in named:
            param.grad = seeded[name]
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def spawned():
    """Each world size's group, spawned once for every test of this module."""
    from tests.conftest import run_ranks

    results: dict[int, list[dict]] = {}

    def of(world: int) -> list[dict]:
        if world not in results:
            results[world] = run_ranks(_flexshard_rank, world)
        return results[world]

    return of


@pytest.mark.parametrize("world", [2, 4])
def test_flexshard_equals_the_single_process_model_and_optimizer(spawned, world):
    results = spawned(world)
    initial, grads = _reference_model()
    first = results[0]
    for rank, result in enumerate(results):
        assert result["ranges"] == first["ranges"], f"rank {rank} planned differently"
        for name, expected in initial.items():  # bit-identical initial weights
            assert torch.equal(result["initial"][name], expected), name
            assert torch.equal(result["initial_expert_parallel"][name], expected), name
        for name, local in result["local_grads"].items():  # each rank holds its own share
            start, stop = first["ranges"][name][rank]
            full = grads[name] if grads[name].ndim == 3 else grads[name].unsqueeze(0)
            torch.testing.assert_close(local, full[start:stop], rtol=1e-4, atol=1e-6)
    for algorithm in ("muon", "adamw"):
        after = _reference_steps(algorithm)
        for result in results:
            steps = result["optimizers"][algorithm]
            assert steps["collectives_in_step"] == [0] * STEPS  # no communication in step()
            for name, expected in after.items():
                assert _relative_error(steps["after"][name], expected) < 1e-6, (algorithm, name)
    total = torch.sqrt(sum(g.pow(2).sum() for g in grads.values())).item()
    assert first["norm"] == pytest.approx(total, rel=1e-5)
    assert len({r["norm"] for r in results}) == 1


def test_once_a_step_sums_in_the_last_backward_equal_the_sums_after_it(spawned):
    """FlexShard's replicas and expert copies sum once a step. Issued in the last
    micro-batch's backward, as each gradient completes, they give the gradients summed
    after it, bit for bit, and nothing is left for ``finish_gradients``."""
    for rank, result in enumerate(spawned(4)):
        after, inside = result["sums_in_backward"][0], result["sums_in_backward"][2]
        for name, grad in after["grads"].items():
            assert torch.equal(inside["grads"][name], grad), (rank, name)
        assert set(after["all_reduces"]) == {"finish_gradients"}
        assert set(inside["all_reduces"]) == {"last backward"}
        for sums in (after, inside):  # each backward reduce-scatters its own gradients
            assert set(sums["reduce_scatters"]) == {"first backward", "last backward"}
        assert len(inside["all_reduces"]) > len(after["all_reduces"])  # one per unit, expert
        assert inside["refused"].startswith("sum_copies_in_backward = 2: a backward beyond it")


def test_mean_over_ranks_false_sums_the_gradients_over_ranks(spawned):
    """``flex_shard(..., mean_over_ranks=False)`` gives each gradient as the sum over the
    data-parallel ranks (the mean times the ranks), for dense units, replicas and resident
    experts alike; the default stays the mean."""
    for result in spawned(2):
        grads = result["mean_and_sum"]
        for kind in ("experts", "replicas"):
            mean, summed = grads[kind, True], grads[kind, False]
            assert mean.keys() == summed.keys()
            for name, grad in mean.items():
                torch.testing.assert_close(summed[name], grad * 2, rtol=1e-6, atol=0, msg=name)


def _one_process_step(monkeypatch, alone: bool) -> tuple[torch.Tensor, dict, list]:
    from europa.flexshard import gather

    monkeypatch.setattr(gather.GatherUnit, "whole_here", property(lambda self: alone))
    gathers, shadows = [], []
    apply, shadow = gather._GatherFunction.apply, gather.GatherUnit._shadow

    def counted(*args):
        gathers.append(args[0])
        return apply(*args)

    def recorded(self, fulls):
        shadows.extend(zip(self.slots, fulls, strict=True))
        return shadow(self, fulls)

    monkeypatch.setattr(gather._GatherFunction, "apply", counted)
    monkeypatch.setattr(gather.GatherUnit, "_shadow", recorded)
    model, layout, _ = _laid_out_model()
    loss = _loss(model, _tokens())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in layout.named_local_parameters()}
    return loss.detach(), grads, [gathers, shadows]


def test_one_process_alone_shadows_its_own_storage_and_gathers_nothing(monkeypatch):
    """One rank holding everything: the shadows are views of the local parameters (no
    copy, no gather, no backward hook), with the gathered path's loss and gradients."""
    gathered_loss, gathered_grads, (gathers, _) = _one_process_step(monkeypatch, alone=False)
    assert gathers  # the gathered path: an autograd gather per unit
    loss, grads, (gathers, shadows) = _one_process_step(monkeypatch, alone=True)
    assert not gathers
    assert shadows and all(
        full.untyped_storage().data_ptr() == slot.local.untyped_storage().data_ptr()
        for slot, full in shadows
    )
    assert torch.equal(loss, gathered_loss)
    assert grads.keys() == gathered_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, gathered_grads[name]), name
