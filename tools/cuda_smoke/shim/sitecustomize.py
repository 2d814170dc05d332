# Smoke-check shim for torch 2.11 (the GPU image), which europa does not support
# (torch >= 2.13): torchtitan 0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims
# (new in torch 2.13) for annotations, and europa calls the single-tensor collectives by
# their torch 2.13 names.
import dataclasses

import torch.distributed as _dist
import torch.distributed.fsdp as _fsdp

for _new, _old in (
    ("all_gather_single", "all_gather_into_tensor"),
    ("reduce_scatter_single", "reduce_scatter_tensor"),
):
    if not hasattr(_dist, _new):
        setattr(_dist, _new, getattr(_dist, _old))

if not hasattr(_fsdp, "DataParallelMeshDims"):

    @dataclasses.dataclass
    class DataParallelMeshDims:
        shard: object = None
        replicate: object = None

    _fsdp.DataParallelMeshDims = DataParallelMeshDims
