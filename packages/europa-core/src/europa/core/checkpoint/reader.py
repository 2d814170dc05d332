"""Reading a checkpoint someone else wrote without running their code.

A DCP checkpoint holds two kinds of pickle: ``.metadata`` (torch reads it with plain
``pickle.load``) and, inside the ``.distcp`` shard files, every non-tensor value
(optimizer hyperparameters, the trainer's step and schedule; torch's default load
planner reads them with ``torch.load(weights_only=False)``). Tensors in the shard files
are read by torch with ``torch.load(weights_only=True)``.

Here ``.metadata`` goes through an unpickler that admits only the classes torch 2.13
writes into it (found in checkpoints of FSDP2 and FlexShard runs with AdamW and Muon,
on 1 and 2 ranks, expert-parallel and not) and plain containers; non-tensor values go
through ``torch.load(weights_only=True)``; and every shard file the metadata names must
be a file inside the checkpoint folder. Anything else is refused in one line before it
is built.

Where the marker recorded checksums, ``.metadata`` is checked whole before it is
unpickled, and each piece of a shard file as it is read (``europa.core.checkpoint.
checksums``), so a flipped bit is refused naming its file, never loaded.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from europa.core.checkpoint.checksums import check_piece
from europa.core.checkpoint.marker import MARKER, FileRecord, Piece, UnreadableMarker, read_marker
from europa.core.errors import CheckpointError, DamagedCheckpoint

METADATA_FILE = ".metadata"

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, from a fixed table
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
}


def _is_torch_constant(module: str, name: str) -> bool:
    """``torch.float32`` and the like: dtypes, memory formats and layouts are constants."""
    if module != "torch":
        return False
    value = getattr(torch, name, None)
    return isinstance(value, torch.dtype | torch.memory_format | torch.layout)


class _RefusedGlobal(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or _is_torch_constant(module, name):
            return super().find_class(module, name)
        raise _RefusedGlobal(f"{module}.{name}")


def read_metadata(checkpoint: Path, saved: FileRecord | None = None) -> Metadata:
    """The checkpoint's DCP metadata, read without running anything it names; checked
    against its ``saved`` size and checksum when given."""
    file = checkpoint / METADATA_FILE
    try:
        content = file.read_bytes()
        _check_whole(file, content, saved)
        metadata = _MetadataUnpickler(io.BytesIO(content)).load()
    except _RefusedGlobal as err:
        raise CheckpointError(
            f"checkpoint metadata {str(file)!r} asks to load {err}, which is not checkpoint "
            "metadata; refused without running it (expected only torch.distributed."
            "checkpoint's metadata classes)"
        ) from None
    except CheckpointError:
        raise
    except OSError as err:
        raise CheckpointError(
            f"checkpoint metadata {str(file)!r}: {err.strerror or err}; expected a readable file"
        ) from None
    except Exception as err:  # a damaged pickle can fail in many ways
        raise CheckpointError(
            f"checkpoint metadata {str(file)!r} is damaged ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no detail'}); expected the file DCP wrote"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint metadata {str(file)!r} holds a {type(metadata).__name__}; "
            "expected torch.distributed.checkpoint Metadata"
        )
    _check_shard_files(file, metadata)
    return metadata


def _check_whole(file: Path, content: bytes, saved: FileRecord | None) -> None:
    if saved is None or saved.crc32c is None:
        return
    check_piece(file, 0, content, Piece(0, saved.bytes or 0, saved.crc32c))


def _check_shard_files(file: Path, metadata: Metadata) -> None:
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or PurePosixPath(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(
                f"checkpoint metadata {str(file)!r} names the shard file {name!r}; expected a "
                "file name inside the checkpoint folder"
            )


class RestrictedFileSystemReader(FileSystemReader):
    """DCP's file system reader with ``read_metadata`` through ``read_metadata`` above
    (or ``checked``, the metadata its caller already read that way), checking each piece
    it reads against ``pieces`` ((file name, offset) -> piece) when the checkpoint
    recorded them. Per-rank metadata files (``__N.metadata``, never written by europa)
    are refused."""

    def __init__(
        self,
        path: str,
        *,
        metadata: FileRecord | None = None,
        pieces: dict[tuple[str, int], Piece] | None = None,
        checked: Metadata | None = None,
    ) -> None:
        super().__init__(path)
        self.saved_metadata = metadata
        self.pieces = pieces
        self.checked = checked

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        if self.pieces is None:  # a checkpoint from before checksums
            return super()._slice_file(file, sinfo)
        where = Path(self.path) / sinfo.relative_path
        piece = self.pieces.get((sinfo.relative_path, sinfo.offset))
        if piece is None or piece.length != sinfo.length:
            raise DamagedCheckpoint(
                str(where),
                f"the metadata names bytes {sinfo.offset}..{sinfo.offset + sinfo.length}, "
                "which the marker does not record",
            )
        file.seek(sinfo.offset)
        content = file.read(sinfo.length)
        check_piece(where, sinfo.offset, content, piece)
        return io.BytesIO(content)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r}: per-rank metadata is not read; expected "
                f"a {METADATA_FILE} file"
            )
        metadata = self.checked or read_metadata(Path(self.path), self.saved_metadata)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are read with
    ``torch.load(weights_only=True)`` (plain values, containers and tensors only)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            detail = str(err).strip().splitlines()[0]
            raise CheckpointError(
                f"checkpoint value {fqn!r} is not plain data ({detail}); refused without "
                "running it (expected numbers, strings, lists, dicts and tensors)"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def saved_checks(
    checkpoint: Path,
) -> tuple[FileRecord | None, dict[tuple[str, int], Piece] | None]:
    """What a complete checkpoint's marker says to check its reads against: the
    metadata's record and every piece, or None for either where it recorded none (or
    for a folder DCP wrote without europa's marker)."""
    if not (checkpoint / MARKER).exists():
        return None, None
    try:
        marker = read_marker(checkpoint)
    except UnreadableMarker:
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r}: its marker file {MARKER} is unreadable; "
            "expected the marker a complete save writes"
        ) from None
    return marker.files.get(METADATA_FILE), (marker.pieces_by_offset() or None)


def load_restricted(
    state: dict[str, Any],
    checkpoint: Path,
    *,
    metadata: FileRecord | None = None,
    pieces: dict[tuple[str, int], Piece] | None = None,
    checked: Metadata | None = None,
    **kwargs: Any,
) -> None:
    """``dcp.load`` of ``checkpoint`` into ``state`` through the restricted reader and
    planner above, checking what it reads against the saved ``metadata`` record and
    ``pieces``; ``checked``: its metadata, already read through ``read_metadata``
    (``kwargs``: the rest of ``dcp.load``'s, e.g. ``no_dist``)."""
    dcp.load(
        state,
        storage_reader=RestrictedFileSystemReader(
            str(checkpoint), metadata=metadata, pieces=pieces, checked=checked
        ),
        planner=WeightsOnlyLoadPlanner(),
        **kwargs,
    )
