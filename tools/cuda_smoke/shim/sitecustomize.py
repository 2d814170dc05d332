# Smoke-check shim for torch 2.11 (the GPU image): torchtitan 0.3.0 imports
# torch.distributed.fsdp.DataParallelMeshDims (new in torch 2.13) for annotations.
import dataclasses

import torch.distributed.fsdp as _fsdp

if not hasattr(_fsdp, "DataParallelMeshDims"):

    @dataclasses.dataclass
    class DataParallelMeshDims:
        shard: object = None
        replicate: object = None

    _fsdp.DataParallelMeshDims = DataParallelMeshDims
