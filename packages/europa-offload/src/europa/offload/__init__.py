"""europa-offload: saved activations and optimizer state in host memory.

Plain API (needs only torch):

* ``offload_activations(blocks, policy)`` / ``ActivationOffload``: wraps blocks so
  their saved activations go to pooled host buffers (asynchronously on CUDA)
  and come back, prefetched a block ahead, in backward;
* ``OffloadPolicy``: minimum tensor size, block-name patterns, blocks kept on the device;
* ``HostBufferPool``: reusable (pinned) host buffers with a byte limit;
* ``OffloadedOptimizer(optimizer)``: optimizer state in host memory between
  steps, streamed to the device chunk by chunk for ``step()``.

``europa.offload.plugin`` adapts these to europa's hooks (``europa train -p offload``).
"""

from europa.spec.lazy import lazy_exports

# The names load on first use (PEP 562), so that importing the plugin module,
# which every ``europa`` command does, does not import torch.
_WHERE = {
    "ActivationOffload": "europa.offload.activations",
    "HostBufferPool": "europa.offload.pool",
    "HostMemoryExceeded": "europa.offload.errors",
    "OffloadError": "europa.offload.errors",
    "OffloadPolicy": "europa.offload.activations",
    "OffloadStats": "europa.offload.activations",
    "OffloadedOptimizer": "europa.offload.optimizer",
    "offload_activations": "europa.offload.activations",
}

__all__ = [
    "ActivationOffload",
    "HostBufferPool",
    "HostMemoryExceeded",
    "OffloadError",
    "OffloadPolicy",
    "OffloadStats",
    "OffloadedOptimizer",
    "offload_activations",
]

__getattr__ = lazy_exports(__name__, _WHERE)
