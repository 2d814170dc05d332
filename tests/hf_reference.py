"""A small DeepSeek-V3-architecture model built by ``transformers`` (the reference we
did not write), saved with ``save_pretrained``; and europa's side of the comparison.

Shape: vocab 2048 (europa's embedded tokenizer), dim 64, 3 layers (1 dense), 4
routed experts top-2 in 2 groups (1 chosen: group-limited routing), 1 shared,
q_lora 24, YaRN RoPE, non-zero routing biases. Logits are compared as
max |a - b| / max |b| in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOLERANCE = 1e-4
HF_CONFIG = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    routed_scaling_factor=1.5,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    num_mtp_layers=0,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.7,
        "mscale_all_dim": 0.7,
        "beta_fast": 16.0,
        "beta_slow": 1.0,
    },
)


def tokens() -> torch.Tensor:
    return torch.randint(
        0, HF_CONFIG["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1)
    )


def save_reference(directory: Path, **shard) -> torch.Tensor:
    """Build, save and run the transformers model; returns its logits on ``tokens()``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**HF_CONFIG)).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.05)  # zero by default: make routing depend on it
        model.save_pretrained(directory, **shard)
        return model(tokens()).logits


def hf_logits(directory: Path) -> torch.Tensor:
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(tokens()).logits


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def model_overrides(directory: Path) -> list[str]:
    """``--set`` strings: the [model] derived from the checkpoint, and init_from it."""
    from europa.core.config.values import show
    from europa.core.hf.config_map import model_table_from_hf

    table = model_table_from_hf(json.loads((directory / "config.json").read_text()), "test")
    table["init_from"] = f"hf:{directory}"
    return [f"model.{k}={show(v)}" for k, v in table.items()]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(tokens())
    model.train()
    return logits


TRAINING = [
    "training.steps=2",
    "training.seq_len=16",
    "training.batch_size=2",
    "metrics.progress=false",
]


def import_train_export(
    rank: int, world: int, root: str, checkpoint: str, runs: list[tuple[str, list[str], list[str]]]
) -> dict[str, dict]:
    """On each rank, for each (name, plugins, overrides): start a run from the HF
    checkpoint, record the imported model's logits and the bytes this rank read,
    train 2 steps (the final checkpoint is what gets exported), record the
    trained model's logits. Rank 0 returns them all."""
    import torch.distributed as dist

    from europa.core.job import Job
    from europa.core.launch.distributed import ProcessPlace, init_distributed
    from europa.core.launch.prepare import prepare_run_dir
    from europa.core.session import open_session
    from europa.core.train.loop import Trainer

    results = {}
    for name, plugins, overrides in runs:
        run_dir = Path(root) / name
        config, manager = open_session(
            "tiny", model_overrides(Path(checkpoint)) + TRAINING + overrides, plugins
        )
        if rank == 0:
            prepare_run_dir(config, run_dir, resume=False)
        dist.barrier()
        device, mesh = init_distributed(
            config.parallel, ProcessPlace(rank, world, rank, "torchrun")
        )
        job = Job(config=config, run_dir=run_dir, rank=rank, world_size=world,
                  local_rank=rank, device=device, mesh=mesh)  # fmt: skip
        trainer = Trainer(job, manager)
        read = [None] * world
        dist.all_gather_object(read, trainer.imported_bytes)
        imported = _logits(trainer.model)
        trainer.run()
        trained = _logits(trainer.model)
        results[name] = {"imported": imported, "trained": trained, "bytes_read": read}
        dist.barrier()
    return results
