"""How much of the copies between host and device a GPU ran beside its kernels, from a
torch.profiler Chrome trace (``export_chrome_trace``): the events of category
``gpu_memcpy`` (host <-> device copies; device-to-device ones are left out) against the
union of the ``kernel`` events. europa-offload's copies run on a side stream; this is
the share of their time that compute hid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _steps import intersect, length, union

HOST_DEVICE = ("HtoD", "DtoH", "Host", "Pinned", "Pageable")


def _span(event: dict[str, Any]) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def _is_host_device_copy(event: dict[str, Any]) -> bool:
    return event.get("cat") == "gpu_memcpy" and any(k in event.get("name", "") for k in HOST_DEVICE)


def copy_compute_overlap(events: list[dict[str, Any]]) -> dict[str, float | int]:
    """Copy time, the part of it beside a kernel, and that share (None without copies)."""
    copies = union([_span(e) for e in events if _is_host_device_copy(e)])
    kernels = union([_span(e) for e in events if e.get("cat") == "kernel"])
    copy_us = length(copies)
    hidden_us = length(intersect(copies, kernels))
    return {
        "copies": len([e for e in events if _is_host_device_copy(e)]),
        "copy_us": copy_us,
        "copy_beside_kernels_us": hidden_us,
        "overlapped_fraction": hidden_us / copy_us if copy_us else None,
        "kernel_us": length(kernels),
    }


def overlap_of_trace(path: Path) -> dict[str, float | int]:
    content = json.loads(path.read_text())
    events = content["traceEvents"] if isinstance(content, dict) else content
    return copy_compute_overlap(events)
