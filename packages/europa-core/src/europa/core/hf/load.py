"""``model.init_from = "hf:DIR"``: fill each rank's parameters from a Hugging Face
checkpoint instead of the random initialiser.

Design note. Core already asks every layout to fill exactly the matrices a
rank holds: ``europa_init_parameters(job, model, init_matrix)`` calls
``init_matrix(name, index, out)`` for matrix ``index`` of each parameter it
holds (FlexShard: whole owned matrices and expert runs; core's FSDP2: its
experts, and its row block of each dense matrix). ``HFInitialiser`` is such an
``init_matrix`` that reads the matrix from the checkpoint, so no layout needs
to know about Hugging Face, and core never imports a technique package. A
layout that holds only part of a matrix (FSDP2's row shards) calls the
optional ``init_matrix.fill_region(name, index, out, region)`` when the
initialiser has one, and the region alone is read from disk. Persistent
buffers (the routing bias) are filled after ``init_buffers`` by
``load_buffers``: they are replicated, so each rank reads them whole.

Everything is checked when the initialiser is built, before any allocation:
the config against ``[model]``, every tensor's presence and shape, and tensors
the checkpoint has that the model would leave unused (MTP layers, which europa
does not build, are the one exception and are skipped).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from europa.core.config.schema import ModelConfig
from europa.core.errors import CheckpointError, ConfigError
from europa.core.hf.config_map import check_model_matches, model_table_from_hf
from europa.core.hf.names import Source, hf_tensors, name_map
from europa.core.hf.reader import SCALE_SUFFIX, HFCheckpoint, Region

PREFIX = "hf:"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def hf_directory(init_from: str) -> str | None:
    """The folder of ``model.init_from = "hf:DIR"``; None for random initialisation."""
    if not init_from:
        return None
    if not init_from.startswith(PREFIX) or len(init_from) == len(PREFIX):
        raise ConfigError(
            f'model.init_from = "{init_from}": expected "" (random initialisation) or '
            '"hf:DIR" (a Hugging Face checkpoint folder)'
        )
    return init_from[len(PREFIX) :]


class HFInitialiser:
    """``init_matrix`` for ``europa_init_parameters`` that reads from ``checkpoint``.
    Build it from the model before sharding (it records every full shape)."""

    def __init__(self, model: nn.Module, spec, config: ModelConfig, checkpoint: HFCheckpoint):
        self.checkpoint = checkpoint
        source = str(checkpoint.path / "config.json")
        check_model_matches(config, model_table_from_hf(checkpoint.config, source), source)
        self.full_shapes = hf_tensors(model)
        self.sources = name_map(spec, self.full_shapes)
        self.skipped = self._check_tensors(config.n_layers)
        self.bytes_read = 0

    def _check_tensors(self, n_layers: int) -> list[str]:
        """Every mapped tensor present with its shape; the checkpoint's extras refused,
        except layers past ``n_layers`` (MTP). Returns the skipped HF names."""
        ckpt = self.checkpoint
        used = set()
        for sources in self.sources.values():
            for s in sources:
                info = ckpt.tensors.get(s.hf_key)
                if info is None and s.name.endswith("expert_bias_E"):
                    continue  # absent from some exports: the bias stays zero
                if info is None:
                    raise CheckpointError(
                        f"{str(ckpt.path)!r} has no tensor {s.hf_key!r} (europa's {s.name}): "
                        "expected every tensor of the model in the checkpoint"
                    )
                if info.shape != s.shape:
                    raise CheckpointError(
                        f"tensor {s.hf_key!r} is {list(info.shape)} in {str(ckpt.path)!r}, "
                        f"but europa's {s.name} needs {list(s.shape)}: expected equal shapes"
                    )
                used.add(s.hf_key)
        skipped = []
        for key in sorted(ckpt.tensors):
            if key in used or (key.endswith(SCALE_SUFFIX) and key[: -len(SCALE_SUFFIX)] in used):
                continue
            layer = _LAYER.match(key)
            if layer and int(layer.group(1)) >= n_layers:
                skipped.append(key)
                continue
            if key.endswith("e_score_correction_bias"):  # europa has none without balancing
                if ckpt.read(key).abs().max().item() > 0:
                    raise ConfigError(
                        f"model.load_balance_coeff = 0, but {key!r} is non-zero: expected "
                        "load_balance_coeff > 0, so europa keeps the checkpoint's routing bias"
                    )
                continue
            raise CheckpointError(
                f"{str(ckpt.path)!r} has tensor {key!r}, which this [model] has no place "
                "for: expected a checkpoint of the same architecture"
            )
        return skipped

    def source(self, name: str, index: int) -> Source:
        return self.sources[name][index]

    def _read(self, name: str, index: int, region: Region | None) -> torch.Tensor:
        key = self.source(name, index).hf_key
        self.bytes_read += self.checkpoint.read_bytes(key, region)
        return self.checkpoint.read(key, region)

    @torch.no_grad()
    def __call__(self, name: str, index: int, out: torch.Tensor) -> None:
        out.copy_(self._read(name, index, None))

    @torch.no_grad()
    def fill_region(self, name: str, index: int, out: torch.Tensor, region: Region) -> None:
        out.copy_(self._read(name, index, tuple(region)))


@torch.no_grad()
def load_buffers(model: nn.Module, init: HFInitialiser) -> None:
    """The persistent buffers (each MoE layer's routing bias), whole on every rank."""
    params = {name for name, _ in model.named_parameters()}
    for name, buffer in model.named_buffers():
        if name in params or name not in init.sources:
            continue
        key = init.source(name, 0).hf_key
        if key in init.checkpoint.tensors:
            buffer.copy_(init.checkpoint.read(key))


def open_initialiser(model: nn.Module, spec, config: ModelConfig) -> HFInitialiser | None:
    """The initialiser for ``model.init_from``, or None when it is empty."""
    directory = hf_directory(config.init_from)
    if directory is None:
        return None
    return HFInitialiser(model, spec, config, HFCheckpoint(directory))
