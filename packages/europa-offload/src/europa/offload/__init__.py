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

from europa.offload.activations import (
    ActivationOffload,
    OffloadPolicy,
    OffloadStats,
    offload_activations,
)
from europa.offload.errors import HostMemoryExceeded, OffloadError
from europa.offload.optimizer import OffloadedOptimizer
from europa.offload.pool import HostBufferPool

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
