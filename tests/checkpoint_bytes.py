"""What a checkpoint's files hold, read from its DCP metadata: for the tests that hold a
checkpoint to the unique state bytes ``europa plan`` reports."""

from __future__ import annotations

import math
from pathlib import Path


def state_bytes_on_disk(checkpoint: Path, parameters: set[str]) -> dict[str, int]:
    """What a checkpoint's files hold: their bytes, the bytes its metadata indexes (each
    written item once), and of the parameters' and their optimizer tensors' items the
    bytes written, the tensor payload and the number of items."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata()

    def of_a_parameter(fqn: str) -> bool:
        if fqn.startswith("model."):
            return fqn.removeprefix("model.") in parameters
        return fqn.startswith("optim.state.") and (
            fqn.removeprefix("optim.state.").rpartition(".")[0] in parameters
        )

    items = [i for idx, i in metadata.storage_data.items() if of_a_parameter(idx.fqn)]
    payload = 0
    for fqn, meta in metadata.state_dict_metadata.items():
        if of_a_parameter(fqn):
            itemsize = meta.properties.dtype.itemsize
            payload += sum(math.prod(c.sizes) * itemsize for c in meta.chunks)
    return {
        "files": sum(p.stat().st_size for p in checkpoint.glob("*.distcp")),
        "indexed": sum(item.length for item in metadata.storage_data.values()),
        "state_written": sum(item.length for item in items),
        "state_payload": payload,
        "state_items": len(items),
    }
