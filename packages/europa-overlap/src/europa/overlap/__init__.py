"""europa-overlap: communication beside computation, and a timeline to see it.

Plain API (needs only torch):

* ``overlap_expert_all_to_all(model, chunks)``: expert-parallel MoE layers
  (europa-flexshard's dispatcher) exchange tokens asynchronously, in chunks,
  with the shared expert computed while they travel; bit-identical results;
* ``prefetch_fsdp(blocks, depth, reshard)`` / ``prefetch_gather_units(units, depth,
  reshard)``: explicit forward and backward prefetch of parameter gathers
  (FSDP2, and europa-flexshard's gather units through their prefetch API);
* ``Timeline``: per step, intervals of compute and of each kind of collective,
  and the communication compute waited for (exposed);
* ``write_trace(run_dir)``: an HTML picture and a Chrome-trace JSON of a run's
  timelines.

``europa.overlap.plugin`` adapts these to europa's hooks (``europa train -p overlap``).
"""

from europa.spec.lazy import lazy_exports

# The names load on first use (PEP 562), so that importing the plugin module,
# which every ``europa`` command does, does not import torch.
_WHERE = {
    "RESHARD_POLICIES": "europa.overlap.prefetch",
    "OverlapError": "europa.overlap.errors",
    "StepTimeline": "europa.overlap.timeline",
    "Timeline": "europa.overlap.timeline",
    "overlap_expert_all_to_all": "europa.overlap.experts",
    "prefetch_fsdp": "europa.overlap.prefetch",
    "prefetch_gather_units": "europa.overlap.prefetch",
    "write_trace": "europa.overlap.trace",
}

__all__ = [
    "RESHARD_POLICIES",
    "OverlapError",
    "StepTimeline",
    "Timeline",
    "overlap_expert_all_to_all",
    "prefetch_fsdp",
    "prefetch_gather_units",
    "write_trace",
]

__getattr__ = lazy_exports(__name__, _WHERE)
