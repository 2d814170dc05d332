"""The stand-in accelerator a rank's program executes on when this machine has no GPU.

Design note. Fake tensors (``torch._subclasses.fake_tensor``) carry shapes, dtypes and
devices without storage, but a CPU-only torch build cannot run autograd on fake ``cuda``
tensors: it registers no CUDA device guard, and autograd asks one for every tensor's
stream. So the GPU a plan is for is stood in for by PyTorch's ``PrivateUse1`` backend,
registered from Python under the name ``STANDIN`` with a Python device guard: autograd,
``torch.Stream``, ``torch.Event`` and ``torch.accelerator`` work on it, and every europa
code path that a GPU takes through those device-generic APIs (europa-offload's side
stream, events and pinned host buffers; europa-flexshard's collectives) is taken here too.

What the stand-in does not do, and says so in the output: it runs nothing concurrently
(a stream is an ordering, not a queue), so an event is complete once recorded
(``StandinEvent.synchronize`` returns at once); pinned host memory is ordinary fake host
memory; autocast has no kernels on it, so a region autocast to fp32 runs in its inputs'
dtype (torchtitan's router computes its gate under fp32 autocast: its (tokens × experts)
scores are then counted at the compute dtype's size). And torch picks an attention kernel
per device type: for an unknown one it takes the math fallback, which holds every
(query, key) score, so ``F.scaled_dot_product_attention`` on the stand-in runs cuDNN's
fused kernel instead, the first fused one in torchtitan's order (cuDNN, flash, math) and
the one a Hopper GPU takes for MLA's unequal query and value head sizes: it keeps the
output and one log-sum-exp per query and head, as flash attention would. A causal mask
aligned to the last key (context parallelism's chunks) runs as its causal kernel: the
same saved tensors.

One process registers it once, before any tensor is made: ``install()``.
"""

from __future__ import annotations

import torch

STANDIN = "gpu"  # the device type fake device tensors carry
STANDIN_NOTE = (
    "device tensors on a stand-in accelerator (PyTorch's PrivateUse1 backend): the GPU path "
    "is taken; streams order but run nothing concurrently, events complete when recorded, "
    "pinned host memory is plain host memory, fp32 autocast regions keep their input dtype, "
    "attention runs cuDNN's fused kernel"
)
_installed: list[object] = []


class _StandinModule:
    """``torch.<STANDIN>``: what torch asks of a backend's device module."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        return None

    # torch.random.fork_rng (a pipeline schedule forks it around its shape inference):
    # nothing is drawn on fake tensors, so there is no generator state to keep
    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device="cpu")

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        return None

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return True


def _fused_attention(original):
    from torch.nn.attention.bias import CausalBias

    def scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        lower_right = isinstance(attn_mask, CausalBias)  # context parallelism's chunks
        masked = attn_mask is not None and not lower_right
        if query.device.type != STANDIN or masked or enable_gqa:
            return original(query, key, value, attn_mask, dropout_p, is_causal,
                            scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        is_causal = is_causal or lower_right  # the same saved tensors, whichever corner
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, grad, dropout_p, is_causal, False, scale=scale
        )[0]

    scaled_dot_product_attention.__wrapped__ = original
    return scaled_dot_product_attention


class StandinEvent(torch.Event):
    """``torch.Event`` on the stand-in: nothing runs concurrently, so a recorded event is
    already complete (the Python device guard cannot wait on one)."""

    def synchronize(self) -> None:
        return None


def install() -> torch.device:
    """Register the stand-in accelerator in this process (once); returns its device."""
    if not _installed:
        torch.utils.backend_registration._setup_privateuseone_for_python_backend(
            STANDIN, backend_module=_StandinModule()
        )
        # A library's registrations last while it is referenced: _installed holds it.
        autocast = torch.library.Library("_", "IMPL")
        autocast.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
        torch.Event = StandinEvent  # looked up at call time by the code that makes events
        functional = torch.nn.functional
        functional.scaled_dot_product_attention = _fused_attention(
            functional.scaled_dot_product_attention
        )
        _installed.append(autocast)
    return torch.device(STANDIN, 0)
