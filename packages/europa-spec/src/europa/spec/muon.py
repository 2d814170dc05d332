"""The optimizer maths every layout must share exactly: Muon's Newton–Schulz
orthogonalisation and update scale, and the AdamW update. Which parameters each steps,
and the state each keeps: ``europa.spec.optim`` (no torch).

AdamW comes two ways, the same update (``torch.optim.AdamW``'s): ``adamw_update`` runs
torch's fused kernel, one kernel per tensor, which core's optimizer uses; its result for
an element depends on where the element falls in its tensor (the kernel's vector body and
its scalar tail round differently: a stack of 6 matrices stepped whole and as two stacks
of 3 differ by 1e-9). ``adamw_update_exact`` is elementwise and gives every element the
same bits however the tensors are split, which FlexShard needs: its layouts (any ``ep``,
any world size) promise the same training, routing decisions included.
``adamw_update_any_split`` keeps that promise at the fused kernel's speed where it can: a
stack whose matrices each hold a multiple of ``FUSED_WHOLE_VECTORS`` elements has no
element in a scalar tail however the stack is cut between matrices, so it goes through the
fused kernel; the rest through the elementwise form. The choice depends on the
parameter's matrix shape alone, so every layout makes the same one.

Muon: the quintic Newton–Schulz iteration with Jordan et al.'s coefficients, in the
parameter's dtype, a 3-D stacked parameter being a batch of independent matrices; the
update is scaled per matrix by ``0.2 * sqrt(max(rows, cols))`` so its RMS matches
AdamW's and one ``lr`` serves both groups (Moonlight, arXiv:2502.16982). Embeddings,
the output head, norms, router gates and biases stay on AdamW, as Muon's authors advise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.adamw import adamw

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalise(matrices: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate U V^T of each matrix in ``[..., rows, cols]`` (quintic Newton–Schulz)."""
    a, b, c = NS_COEFFICIENTS
    x = matrices.float()
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if transposed:
        x = x.mT
    return x.to(matrices.dtype)


def rms_matching_scale(shape: Sequence[int]) -> float:
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def adamw_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fresh AdamW state for ``param`` (its step counter on the parameter's device, as
    the fused kernel needs)."""
    return {
        "step": torch.zeros((), dtype=torch.float32, device=param.device),
        "exp_avg": torch.zeros_like(param),
        "exp_avg_sq": torch.zeros_like(param),
    }


def adamw_hyperparameters(
    *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> tuple[float, tuple[float, float], float, float]:
    """(lr, betas, eps, weight_decay): the keywords every form of the AdamW update takes,
    each required."""
    return lr, betas, eps, weight_decay


def adamw_keywords(group: dict[str, Any]) -> dict[str, Any]:
    """An optimizer group's AdamW hyperparameters, as the update's keywords."""
    return {key: group[key] for key in ("lr", "betas", "eps", "weight_decay")}


@torch.no_grad()
def adamw_update(params: list[torch.Tensor], states: list[dict[str, torch.Tensor]], **hyper):
    """torch's fused AdamW kernel on ``params`` (each with its ``.grad``) and their states:
    the update of ``torch.optim.AdamW``, one kernel per tensor. ``hyper``: ``lr``,
    ``betas``, ``eps`` and ``weight_decay`` (``adamw_hyperparameters``)."""
    lr, (beta1, beta2), eps, weight_decay = adamw_hyperparameters(**hyper)
    if not params:
        return
    adamw(
        params,
        [p.grad for p in params],
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [],
        [s["step"] for s in states],
        fused=True,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )


# torch's CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) cuts a tensor into
# units of one 64-byte cache line, gives each thread whole units, and runs its vector body
# over each thread's share: only the tensor's last numel % (vector width) elements take the
# scalar tail. 64 elements is a whole number of vectors for every dtype and ISA it has
# (16 fp32 or 32 bf16 lanes with AVX512); its CUDA kernel does the same arithmetic for
# every element wherever it lies.
FUSED_WHOLE_VECTORS = 64


def takes_fused_adamw(param: torch.Tensor) -> bool:
    """Whether ``adamw_update_any_split`` steps ``param`` through the fused kernel: each of
    its matrices (a 3-D parameter is a stack of them, cut only between matrices; anything
    else is one) a whole number of vectors, and contiguous."""
    per_matrix = math.prod(param.shape[1:]) if param.dim() == 3 else param.numel()
    return per_matrix % FUSED_WHOLE_VECTORS == 0 and param.is_contiguous()


@torch.no_grad()
def adamw_update_any_split(
    params: list[torch.Tensor], states: list[dict[str, torch.Tensor]], **hyper
) -> None:
    """AdamW whose every element has the same bits however its stack is cut between
    matrices: the fused kernel where ``takes_fused_adamw``, else the elementwise form.
    ``hyper``: as ``adamw_update``'s."""
    fused = [takes_fused_adamw(p) for p in params]
    for update, wanted in ((adamw_update, True), (adamw_update_exact, False)):
        chosen = [i for i, f in enumerate(fused) if f is wanted]
        update([params[i] for i in chosen], [states[i] for i in chosen], **hyper)


@torch.no_grad()
def adamw_update_exact(
    params: list[torch.Tensor], states: list[dict[str, torch.Tensor]], **hyper
) -> None:
    """The same update as ``adamw_update``, elementwise: each element's result does not
    depend on how its tensor is split (see the module's note). ``hyper``: as
    ``adamw_update``'s."""
    lr, (beta1, beta2), eps, weight_decay = adamw_hyperparameters(**hyper)
    for param, state in zip(params, states, strict=True):
        state["step"] += 1
        step = state["step"].item()
        state["exp_avg"].lerp_(param.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(eps)
        param.mul_(1 - lr * weight_decay)
        param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


def muon_adamw_defaults(
    *,
    lr: float,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    ns_steps: int = 5,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> dict[str, Any]:
    """The hyperparameters every Muon/AdamW optimizer takes (each group's defaults):
    ``lr``, decoupled ``weight_decay``, Muon's Nesterov ``momentum`` and Newton–Schulz
    ``ns_steps``, AdamW's ``betas`` and ``eps``."""
    return dict(
        lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps, betas=betas, eps=eps
    )


def nesterov_momentum(param: torch.Tensor, buffer: torch.Tensor, momentum: float) -> torch.Tensor:
    """Fold ``param.grad`` into its momentum ``buffer``; the Nesterov direction to
    orthogonalise."""
    buffer.lerp_(param.grad, 1 - momentum)
    return param.grad.lerp(buffer, momentum)


def apply_muon_update(param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> None:
    """Decoupled weight decay, then the orthogonalised ``update`` at the group's ``lr``,
    scaled by ``rms_matching_scale`` of the parameter's matrices."""
    param.mul_(1 - group["lr"] * group["weight_decay"])
    param.add_(update, alpha=-group["lr"] * rms_matching_scale(param.shape))


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """What ``torch.optim.Optimizer.step(closure)`` does first: the loss ``closure``
    returns, with gradients on (None without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


__all__ = [
    "FUSED_WHOLE_VECTORS",
    "NS_COEFFICIENTS",
    "adamw_hyperparameters",
    "adamw_keywords",
    "adamw_state",
    "adamw_update",
    "adamw_update_any_split",
    "adamw_update_exact",
    "apply_muon_update",
    "closure_loss",
    "muon_adamw_defaults",
    "nesterov_momentum",
    "orthogonalise",
    "rms_matching_scale",
    "takes_fused_adamw",
]
