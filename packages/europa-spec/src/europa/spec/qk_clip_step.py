"""QK-clip once a step, in any trainer (europa's, or torchtitan's through an adapter): arm
the attentions, agree on the maxima, turn them into row factors, report them. The
arithmetic is ``europa.spec.qk_clip``'s, the recording ``europa.spec.logit_max``'s.

Each step: the armed attentions record their heads' largest logits in the training
forwards; before the optimizer step (and before a fault-tolerant vote, where torchft's
collectives end) ``agreed_maxima`` packs them into one (layers, heads) float32 tensor and
takes one MAX over the ranks of ``group`` (default: every rank; each pipeline stage fills
its own layers and -inf elsewhere, so every stage gets its own layers' maxima and rank 0
the whole model's) and, with fault tolerance, one more over the replica groups. After the
optimizer step ``row_factors`` turns them into the factors of the query and key rows of
each held layer with a clipped head, which the layout applies to the rows it holds
(``scale_held_rows`` for plain and DTensor parameters; a layout with its own storage
applies them itself).

An attention is found by its attributes, as torchtitan's DeepSeek-V3 MLA has them
(``n_heads``, ``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
``wkv_b``, ``inner_attention``), at ``layers.<i>`` of the model (wrappers' names between
are allowed: torchtitan's checkpoint wrapper, torch.compile's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from europa.spec.logit_max import LogitMax, arm
from europa.spec.metrics import QK_HEADS_CLIPPED, QK_LOGIT_MAX
from europa.spec.qk_clip import (
    KEY_VALUE,
    MAXIMA_TRAFFIC,
    QUERY,
    MLAHeads,
    clip_gammas,
    row_factors,
    scale_rows_,
)
from europa.spec.replicas import ReplicaGroups
from europa.spec.tags import mark_traffic

MLA_ATTRIBUTES = ("n_heads", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "wkv_b", "inner_attention")  # fmt: skip


def is_mla(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in MLA_ATTRIBUTES)


def layer_index(module_name: str) -> int:
    """``layers.3.attention`` (or ``layers.3._checkpoint_wrapped_module.attention``) → 3."""
    parts = module_name.split(".")
    if len(parts) < 3 or parts[0] != "layers" or parts[-1] != "attention":
        raise ValueError(f"QK-clip: attention at {module_name!r}; expected layers.<i>.attention")
    return int(parts[1])


class QKClip:
    """The clip of ``model``'s MLA attentions (a pipeline stage: the layers it holds) at
    ``tau``; ``n_layers``: the whole model's."""

    def __init__(self, model: torch.nn.Module, n_layers: int, tau: float) -> None:
        self.n_layers, self.tau = n_layers, tau
        self.layers: dict[int, tuple[LogitMax, str, str]] = {}
        heads = None
        for name, module in model.named_modules():
            if not is_mla(module):
                continue
            heads = MLAHeads(module.n_heads, module.qk_nope_head_dim,
                             module.qk_rope_head_dim, module.v_head_dim)  # fmt: skip
            query = "wq" if module.q_lora_rank == 0 else "wq_b"
            recorder = arm(module.inner_attention, module.n_heads)
            prefix = f"{name}." if name else ""
            self.layers[layer_index(name)] = (
                recorder,
                f"{prefix}{query}.weight",
                f"{prefix}wkv_b.weight",
            )
        self.heads = heads
        self.last_metrics: dict = {}
        if heads is None:
            raise ValueError("QK-clip: the model holds no MLA attention")

    def agreed_maxima(
        self,
        device: torch.device,
        replicas: ReplicaGroups | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """Every layer's heads' largest logits this step, the same on every rank of
        ``group`` and every replica (a collective); the recorders start again."""
        maxima = torch.full((self.n_layers, self.heads.n_heads), float("-inf"))
        for layer, (recorder, _, _) in self.layers.items():
            maxima[layer] = recorder.read()
            recorder.reset()
        maxima = maxima.to(device)
        mark_traffic(maxima, MAXIMA_TRAFFIC)
        if dist.is_initialized():
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        if replicas is not None:
            replicas.maximum(maxima)
        return maxima.cpu()

    def row_factors(self, maxima: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows to scale in this rank's layers: {parameter name: factor per row}."""
        gammas = clip_gammas(maxima, self.tau)
        factors = {}
        for layer, (_, query, key_value) in self.layers.items():
            if bool((gammas[layer] < 1).any()):
                factors[query] = row_factors(self.heads, QUERY, gammas[layer])
                factors[key_value] = row_factors(self.heads, KEY_VALUE, gammas[layer])
        return factors

    def metrics(self, maxima: torch.Tensor, applied: bool) -> dict:
        """The largest logit of each layer (over its heads), and the heads clipped (none
        when the optimizer did not step: a skipped or uncommitted step)."""
        largest = maxima.amax(dim=1).tolist()
        return {
            QK_LOGIT_MAX: {f"layers.{i}": value for i, value in enumerate(largest)},
            QK_HEADS_CLIPPED: int((maxima > self.tau).sum()) if applied else 0,
        }


def scale_held_rows(model: torch.nn.Module, factors: dict[str, torch.Tensor]) -> int:
    """Plain parameters (every row) and DTensors (the local shard's rows, from its global
    offset: FSDP2, HSDP)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    params = dict(model.named_parameters())
    scaled = 0
    with torch.no_grad():
        for name, factor in factors.items():
            param = params[name]
            if isinstance(param, DTensor):
                _, offset = compute_local_shape_and_global_offset(
                    param.shape, param.device_mesh, param.placements
                )
                scaled += scale_rows_(param.to_local(), factor, offset[0])
            else:
                scaled += scale_rows_(param, factor, 0)
    return scaled


def install_qk_clip(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    *,
    n_layers: int,
    tau: float,
    scale: Callable[[dict[str, torch.Tensor]], object] | None = None,
    before_step: Callable[[Callable[[], None]], object] | None = None,
    group: dist.ProcessGroup | None = None,
) -> QKClip:
    """QK-clip around ``optimizer``'s steps, for a trainer that is not europa's (torchtitan's
    ``OptimizersContainer`` is a torch optimizer): the maxima are agreed before each step
    (``before_step(fn)`` registers ``fn`` to run then; default: a step pre-hook) and the
    rows scaled after it (a step post-hook) by ``scale(factors)`` (default:
    ``scale_held_rows`` on ``model``: plain and DTensor parameters). Each step's metrics
    are left in the returned clip's ``last_metrics``."""
    clip = QKClip(model, n_layers, tau)
    device = next(model.parameters()).device
    agreed: list[torch.Tensor] = []

    def agree() -> None:
        agreed[:] = [clip.agreed_maxima(device, group=group)]

    def rescale(*_: object) -> None:
        maxima = agreed.pop()
        factors = clip.row_factors(maxima)
        if factors:
            (scale or (lambda f: scale_held_rows(model, f)))(factors)
        clip.last_metrics = clip.metrics(maxima, applied=True)

    if before_step is None:
        optimizer.register_step_pre_hook(lambda *_: agree())
    else:
        before_step(agree)
    optimizer.register_step_post_hook(rescale)
    return clip


__all__ = [
    "MLA_ATTRIBUTES",
    "QKClip",
    "install_qk_clip",
    "is_mla",
    "layer_index",
    "scale_held_rows",
]
