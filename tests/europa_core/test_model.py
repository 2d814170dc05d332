"""The EUROPA MoE: shapes, counts, the fp32 expert path and initialisation."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.deepseek_v3 import deepseekv3_configs

from europa.core.config import load_config
from europa.core.model import build_moe_model, count_parameters
from europa.core.model.experts import NativeDtypeGroupedExperts
from europa.core.model.materialise import materialise


def _materialised(preset: str = "tiny", seed: int = 0, **overrides):
    config = load_config(preset, [f"{k}={v}" for k, v in overrides.items()])
    model = build_moe_model(config.model)
    materialise(model, torch.device("cpu"), seed)
    return config, model


def test_every_preset_builds_on_meta_without_allocating():
    for preset in ("tiny", "debug", "kimi-k2"):
        model = build_moe_model(load_config(preset).model)
        assert all(p.device.type == "meta" for p in model.parameters())


def test_debug_preset_has_the_shape_of_torchtitans_debugmodel():
    ours = build_moe_model(load_config("debug").model)
    with torch.device("meta"):
        theirs = deepseekv3_configs["debugmodel"](
            attn_backend="flex", moe_comm_backend="standard"
        ).build()
    our_shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    their_shapes = {n: tuple(p.shape) for n, p in theirs.named_parameters()}
    assert our_shapes == their_shapes
    assert count_parameters(ours).total == sum(p.numel() for p in theirs.parameters())


def test_kimi_k2_counts_match_the_published_size():
    counts = count_parameters(build_moe_model(load_config("kimi-k2").model))
    assert 1.00e12 < counts.total < 1.06e12  # published: about 1.04 T
    assert 32.0e9 < counts.active_per_token < 34.0e9  # published: about 32 B active
    assert counts.routed_experts > 0.95 * counts.total


def test_active_parameters_count_top_k_of_the_routed_experts():
    config = load_config("tiny")
    model = build_moe_model(config.model)
    counts = count_parameters(model)
    m = config.model
    moe_layers = m.n_layers - m.n_dense_layers
    per_expert = 3 * m.dim * m.moe_hidden_dim
    assert counts.routed_experts == moe_layers * m.num_experts * per_expert
    inactive = moe_layers * (m.num_experts - m.top_k) * per_expert
    assert counts.active_per_token == counts.total - inactive


def test_fp32_and_bf16_expert_paths_have_the_same_parameters():
    m = load_config("tiny").model
    fp32 = build_moe_model(m, native_dtype_experts=True)
    bf16 = build_moe_model(m, native_dtype_experts=False)
    assert [(n, p.shape) for n, p in fp32.named_parameters()] == [
        (n, p.shape) for n, p in bf16.named_parameters()
    ]


def test_native_dtype_experts_match_a_per_expert_loop():
    torch.manual_seed(0)
    experts = NativeDtypeGroupedExperts.Config(dim=16, hidden_dim=24, num_experts=4).build()
    for weight in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD):
        torch.nn.init.normal_(weight, std=0.2)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), 16)
    out = experts(x, counts)
    assert out.dtype == torch.float32
    expected, start = [], 0
    for e, n in enumerate(counts.tolist()):
        chunk = x[start : start + n]
        hidden = torch.nn.functional.silu(chunk @ experts.w1_EFD[e].T) * (
            chunk @ experts.w3_EFD[e].T
        )
        expected.append(hidden @ experts.w2_EDF[e].T)
        start += n
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_forward_and_backward_on_cpu_in_fp32():
    config, model = _materialised()
    tokens = torch.randint(0, config.model.vocab_size, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, config.model.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_initialisation_is_seeded():
    _, first = _materialised(seed=3)
    _, again = _materialised(seed=3)
    _, other = _materialised(seed=4)
    for (name, a), b, c in zip(
        first.state_dict().items(),
        again.state_dict().values(),
        other.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name
        if name.endswith("w1_EFD"):
            assert not torch.equal(a, c), name


def test_routed_experts_start_distinct():
    _, model = _materialised()
    w1 = model.layers["1"].moe.routed_experts.inner_experts.w1_EFD
    for i in range(w1.shape[0]):
        for j in range(i + 1, w1.shape[0]):
            assert not torch.equal(w1[i], w1[j])


def _sharded_init(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = load_config("tiny")
    model = build_moe_model(config.model)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialise(model, torch.device("cpu"), seed=0)
    sharded = {n: p for n, p in model.named_parameters() if isinstance(p, DTensor)}
    assert len(sharded) == len(list(model.parameters()))
    return {n: p.full_tensor().detach().clone() for n, p in sharded.items()}


def test_sharded_initialisation_equals_single_process_initialisation(ranks):
    gathered = ranks(_sharded_init, 2)
    _, reference = _materialised()
    for name, full in reference.named_parameters():
        for rank_view in gathered:
            assert torch.equal(rank_view[name], full.detach()), name


def test_each_matrix_is_drawn_from_its_own_seed():
    from europa.core.model import MatrixInitialiser
    from europa.core.seeds import matrix_seed

    config, model = _materialised(seed=5)
    name = "layers.1.moe.routed_experts.inner_experts.w1_EFD"
    stacked = dict(model.named_parameters())[name]
    alone = torch.empty(stacked.shape[1:])
    MatrixInitialiser(build_moe_model(config.model), seed=5)(name, 3, alone)
    assert torch.equal(alone, stacked[3].detach())
    std = 0.02  # w1 of every layer: torchtitan's DeepSeek-V3 base std
    expected = torch.nn.init.trunc_normal_(
        torch.empty(stacked.shape[1:]),
        std=std,
        generator=torch.Generator().manual_seed(matrix_seed(5, name, 3)),
    )
    assert torch.equal(alone, expected)


class _PlainNet(torch.nn.Module):
    """No torchtitan param_init anywhere: initialised through reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 6)
        self.second = torch.nn.Linear(6, 3)


def test_a_model_without_param_init_falls_back_to_reset_parameters():
    with torch.device("meta"):
        model = _PlainNet()
    materialise(model, torch.device("cpu"), seed=7)
    with torch.device("meta"):
        again = _PlainNet()
    materialise(again, torch.device("cpu"), seed=7)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    bound = 1 / 4**0.5  # nn.Linear's reset_parameters: U(-1/sqrt(in), 1/sqrt(in))
    assert model.first.weight.abs().max() <= bound
    assert model.first.weight.std() > 0.1
    assert not torch.equal(model.first.weight[:3], model.second.weight[:, :4])


def test_a_model_without_moe_layers_has_no_expert_load():
    from europa.core.model import update_expert_bias

    load = update_expert_bias(torch.nn.Linear(2, 2))
    assert load.shares == {} and load.imbalance() == {}


def test_a_node_limit_makes_the_routers_groups_the_nodes_of_an_ep_group():
    """parallel.ep_max_nodes_per_token = 1 with ep = 4 over nodes of 2: the router's groups are
    the two nodes' experts, and every token's top-k experts sit on one of them."""
    from europa.core.launch.distributed import routed_model

    config = load_config("tiny", ["parallel.ep=4", "parallel.ep_max_nodes_per_token=1"])
    routed = routed_model(config, world_size=4, per_node=2)
    assert (routed.num_expert_groups, routed.num_limited_groups) == (2, 1)
    assert routed_model(load_config("tiny"), 4, 2) == load_config("tiny").model  # off: as is
    model = build_moe_model(routed)
    materialise(model, torch.device("cpu"), seed=0)
    router = next(m for n, m in model.named_modules() if n.endswith("router"))
    x = torch.randn(4, 64, routed.dim, generator=torch.Generator().manual_seed(0))
    _, ids, _ = router(x)
    half = routed.num_experts // 2
    assert bool(((ids // half).amin(-1) == (ids // half).amax(-1)).all())
    free = next(m for n, m in _materialised()[1].named_modules() if n.endswith("router"))
    _, free_ids, _ = free(x)
    assert not bool(((free_ids // half).amin(-1) == (free_ids // half).amax(-1)).all())
