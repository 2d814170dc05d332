"""The one tensor europa hands torch.distributed.checkpoint (DCP) for a region of a
larger tensor: a checkpoint chunk a rank writes (FlexShard's owned matrices), or the
region a reader wants back (``europa export-hf`` reading a run of experts).

It speaks DCP's own ``_Checkpointable`` protocol (the one DTensor implements), so it
can say "matrices 2-4 of this stack on rank 1", which DTensor placements cannot and
without the deprecated ShardedTensor. DCP's private protocol is used from this one
place, so a torch release that changes it is mended once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class OwnedChunk(torch.Tensor):
    """A tensor of shape ``size`` of which this rank holds ``local`` at ``offsets``
    (or nothing, ``local=None``). For checkpointing only: any operation on it fails."""

    @staticmethod
    def __new__(
        cls, size: torch.Size, local: torch.Tensor, offsets: tuple[int, ...] | None
    ) -> OwnedChunk:
        chunk = torch.Tensor._make_wrapper_subclass(
            cls, size, dtype=local.dtype, device=local.device, requires_grad=False
        )
        chunk._local = local
        chunk._offsets = offsets
        return chunk

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.new_empty.default:
            return cls._staging_shell(args[0])
        raise RuntimeError(f"OwnedChunk only carries a checkpoint chunk; {func} is not supported")

    @classmethod
    def _staging_shell(cls, chunk: OwnedChunk) -> OwnedChunk:
        """What DCP's stager copies a chunk into: it then sets ``_local`` and
        ``_offsets`` to copies of the chunk's own (a background save)."""
        return cls(chunk.size(), chunk._local.new_empty(0, device="cpu"), chunk._offsets)

    def __reduce_ex__(self, protocol: int) -> tuple:
        # To a writer process: the local tensor goes by its own reduction (shared memory).
        return (OwnedChunk, (self.size(), self._local, self._offsets))

    @property
    def local(self) -> torch.Tensor:
        """The part this rank holds (empty where it holds none)."""
        return self._local

    def _chunks(self) -> list[ChunkStorageMetadata]:
        if self._offsets is None:
            return []
        return [ChunkStorageMetadata(torch.Size(self._offsets), self._local.size())]

    # -- torch.distributed.checkpoint's _Checkpointable protocol --------------------------

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self._local),
                    size=self.size(),
                ),
            )
            for chunk in self._chunks()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._local


__all__ = ["OwnedChunk"]
