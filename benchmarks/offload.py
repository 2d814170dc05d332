"""Activation offload: no offload, torch's ``save_on_cpu`` and europa-offload, in one run.

One process trains three copies of the same model (the ``debug`` preset by
default, long sequences so that activations dominate) on the same batches,
taking turns step by step so that machine noise hits all three. Reported per
variant: the median step time, the bytes copied out per step, the peak of
saved bytes left on the compute device (saved activations, weights aside;
on a GPU ``save_on_cpu`` leaves none, on a CPU it moves nothing: its
``tensor.cpu()`` is the tensor itself), and on CUDA ``torch.cuda.max_memory_allocated``
over a step; then the ratios against no offload and against ``save_on_cpu``.

On CUDA, ``--trace DIR`` also profiles one more europa-offload step and reports from its
Chrome trace (written to DIR) the share of host <-> device copy time that ran beside
kernels (``_gpu_trace``), and the goals (peak memory at most 0.6 of no offload's, within
1.15 of its step time) as booleans.

    python benchmarks/offload.py [--json] [--preset debug] [--seq-len 1024] [--steps 4]
                                 [--trace DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import print_result


class _SavedBytes:
    """Counts the activation bytes autograd keeps (weights aside) and their peak."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def hooks(self):
        def pack(t: torch.Tensor):
            if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
                self.now += t.numel() * t.element_size()
                self.peak = max(self.peak, self.now)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _model(preset: str, device: torch.device) -> nn.Module:
    from europa.core.config import load_config
    from europa.core.model import build_moe_model, materialise

    config = load_config(preset)
    model = build_moe_model(config.model, native_dtype_experts=device.type == "cpu")
    materialise(model, device, seed=0)
    return model


def _step(model: nn.Module, tokens: torch.Tensor, context) -> float:
    started = time.perf_counter()
    with context():
        logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    if tokens.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _traced_overlap(model, tokens, offload, folder: Path) -> dict:
    """One offloaded step under torch.profiler; the copies' overlap with kernels."""
    from _gpu_trace import overlap_of_trace
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / "offload_step_trace.json"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(model, tokens, contextlib.nullcontext)
    offload.release()
    offload.take_stats()
    prof.export_chrome_trace(str(trace))
    return {"trace": str(trace), **overlap_of_trace(trace)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up")
    parser.add_argument("--min-tensor-kib", type=int, default=256)
    parser.add_argument("--trace", type=Path, help="CUDA: profile one offloaded step here")
    args = parser.parse_args()

    from europa.offload import OffloadPolicy, offload_activations

    warnings.filterwarnings("ignore", message="In CPU autocast")  # torchtitan's fp32 router

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    base = _model(args.preset, device)
    models = {"none": base, "save_on_cpu": copy.deepcopy(base), "europa": copy.deepcopy(base)}
    offload = offload_activations(
        models["europa"].layers.values(),
        OffloadPolicy(min_bytes=args.min_tensor_kib << 10, keep_last_blocks=1),
    )
    contexts = {
        "none": contextlib.nullcontext,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda),
        "europa": contextlib.nullcontext,
    }
    vocab = base.tok_embeddings.num_embeddings
    times: dict[str, list[float]] = {name: [] for name in models}
    peaks: dict[str, int] = {}
    offloaded: dict[str, int] = {}
    for step in range(args.steps + 1):
        generator = torch.Generator().manual_seed(step)
        shape = (args.batch_size, args.seq_len + 1)
        tokens = torch.randint(0, vocab, shape, generator=generator).to(device)
        for name, model in models.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            elapsed = _step(model, tokens, contexts[name])
            if step:  # the first step warms up (and fills europa-offload's pool)
                times[name].append(elapsed)
                if cuda:
                    peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated())
            if name == "europa":
                offload.release()
                stats = offload.take_stats()
                offloaded["europa"] = stats.bytes_offloaded
                europa_left = stats.peak_saved_device_bytes

    counted = _SavedBytes()  # what no offload keeps on the device
    with counted.hooks():
        _step(base, tokens, contextlib.nullcontext)
    # save_on_cpu copies every saved tensor (weights too) off a GPU; on a CPU it keeps
    # the tensors themselves (``tensor.cpu()`` is the tensor), so nothing moves.
    offloaded["save_on_cpu"] = counted.peak if cuda else 0
    offloaded["none"] = 0
    left = {"none": counted.peak, "save_on_cpu": 0 if cuda else counted.peak, "europa": europa_left}
    median = {name: statistics.median(samples) for name, samples in times.items()}
    configs = [
        {
            "variant": name,
            "step_s": median[name],
            "bytes_offloaded_per_step": offloaded[name],
            "peak_saved_device_bytes": left[name],
            **({"cuda_max_memory_allocated": peaks[name]} if cuda else {}),
        }
        for name in models
    ]
    comparisons = {
        "step_time_europa_over_none": median["europa"] / median["none"],
        "step_time_save_on_cpu_over_none": median["save_on_cpu"] / median["none"],
        "step_time_europa_over_save_on_cpu": median["europa"] / median["save_on_cpu"],
        "pool_allocations_after_warm_up": offload.pool.allocations,
    }
    if cuda:
        comparisons["cuda_peak_europa_over_none"] = peaks["europa"] / peaks["none"]
        comparisons["cuda_peak_save_on_cpu_over_none"] = peaks["save_on_cpu"] / peaks["none"]
        comparisons["goal_peak_at_most_0.6_of_none"] = peaks["europa"] / peaks["none"] <= 0.6
        comparisons["goal_step_within_1.15_of_none"] = median["europa"] / median["none"] <= 1.15
    if args.trace is None:
        comparisons["copy_compute_overlap"] = {"skipped": "no --trace DIR"}
    elif not cuda:
        comparisons["copy_compute_overlap"] = {"skipped": "no CUDA device: nothing is copied"}
    else:
        comparisons["copy_compute_overlap"] = _traced_overlap(
            models["europa"], tokens, offload, args.trace
        )
    print_result("offload", args, configs, comparisons, device=device.type)


if __name__ == "__main__":
    main()
