"""europa-flexshard used alone: the README's loop, torchtitan's own DeepSeek-V3, and
an install beside torch and pluggy only, without europa-core."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.installs import python_with_only, run_each_without_core

PACKAGE = Path(__file__).resolve().parents[2] / "packages" / "europa-flexshard"


def _readme_example(section: str = "In your own training loop") -> str:
    text = (PACKAGE / "README.md").read_text()
    return re.search(rf"## {section}\n.*?```python\n(.*?)```", text, re.S).group(1)


def _run_readme(namespace: dict) -> list[float]:
    exec(compile(_readme_example(), "README.md", "exec"), namespace)
    return namespace["losses"]


def _torchtitan_deepseek_step() -> dict:
    """torchtitan's DeepSeek-V3 debug model, laid out and stepped in a hand-written loop."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    from europa.flexshard import FlexShardOptimizer, flex_shard

    config = deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard")
    config.layers = config.layers[:2]  # two blocks (one dense, one MoE) keep it quick
    for layer in config.layers:  # FlexAttention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    layout = flex_shard(model)
    before = {n: p.detach().clone() for n, p in layout.named_local_parameters()}
    optimizer = FlexShardOptimizer(layout, lr=0.01)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator())
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    with CommDebugMode() as comm:
        optimizer.step()
    unchanged = [
        n for n, p in layout.named_local_parameters() if p.numel() and torch.equal(p, before[n])
    ]
    stacked = layout.plan.spec("layers.1.moe.routed_experts.inner_experts.w1_EFD")
    return {
        "loss": loss.item(),
        "collectives_in_step": comm.get_total_counts(),
        "owned": sum(p.numel() for _, p in layout.named_local_parameters()),
        "unchanged_owned": unchanged,
        "experts_owned": len(layout.owned_indices(stacked.name)),
    }


def _standalone_rank(rank: int, world: int) -> dict:
    return {"readme_loss": _run_readme({"__name__": "readme"}), **_torchtitan_deepseek_step()}


@pytest.mark.distributed
def test_the_readme_loop_and_torchtitans_deepseek_v3_run_on_two_ranks(ranks):
    results = ranks(_standalone_rank, 2)
    alone = _run_readme({"__name__": "readme"})  # one process owns every matrix
    for result in results:
        # Every rank saw the whole batch: averaged gradients equal one process's.
        assert result["readme_loss"] == pytest.approx(alone, rel=1e-5)
        assert result["readme_loss"][-1] < result["readme_loss"][0] - 1.0
        assert torch.isfinite(torch.tensor(result["loss"]))
        assert result["collectives_in_step"] == 0
        assert result["owned"] > 0 and result["unchanged_owned"] == []
    assert sum(r["experts_owned"] for r in results) == 8  # the debug model's experts, once each


def test_the_package_installs_and_imports_without_core(tmp_path):
    """A fresh environment holding torch, pluggy and this package, but no europa-core."""
    python = python_with_only(tmp_path, "europa-flexshard")
    out, titan = run_each_without_core(
        python,
        [
            "import europa.flexshard, europa.flexshard.plugin\n"
            "from europa.flexshard import FlexShardOptimizer, flex_shard\n"
            "import torch\n"
            "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
            "layout = flex_shard(model)\n"
            "model(torch.randn(3, 4)).sum().backward()\n"
            "FlexShardOptimizer(layout, lr=0.1).step()\n"
            "print('ok', europa.flexshard.plugin.NAME)",
            # The torchtitan section's block: torchtitan's job config, laid out by flexshard.
            _readme_example("In torchtitan") + "\nprint(type(config).__qualname__)",
        ],
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok flexshard"
    assert titan.returncode == 0, titan.stderr
    assert titan.stdout.strip().endswith("FlexShardTrainer.Config")
