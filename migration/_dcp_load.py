"""Loading a stripped DCP folder with ``dcp.load``: :class:`StrippedLoadPlanner`.

Strip writes each attention module's biases as ``q_proj_bias`` and ``v_proj_bias`` (``k_proj_bias``
too for ``add_zero_attn``), while a model's state dict, stock's or slim's, holds ``in_proj_bias``.
The planner maps one onto the other inside DCP's own load: ``in_proj_bias`` is described as a tensor
whose query and value slots are chunks stored under the stripped names, so each rank reads just the
part of them its shard covers, and its key slot is zeroed, which is what slim computes with and what
``fold`` writes. Every other entry loads as ``DefaultLoadPlanner`` loads it.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

__all__ = ["StrippedLoadPlanner"]

_SLOTS = ("q_proj_bias", "k_proj_bias", "v_proj_bias")  # the slots of in_proj_bias, in its order


class StrippedLoadPlanner(DefaultLoadPlanner):
    """``dcp.load(state_dict, checkpoint_id=DIR, planner=StrippedLoadPlanner())`` for a folder that
    ``slim-mha-migrate strip`` wrote; under FSDP2 as in one process. Entries the folder holds in stock's
    layout load unchanged, so it reads any folder ``dcp.load`` reads."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if self.metadata is None:
            return
        for fqn, tensor in self.state_dict.items():
            if fqn.endswith("in_proj_bias") and fqn not in self.metadata.state_dict_metadata:
                self._describe_packed(fqn, tensor)

    def _describe_packed(self, fqn: str, tensor) -> None:
        """Describe ``fqn`` (``in_proj_bias``, ``3E``) by its stored slots, in place in the metadata
        that DCP's reader shares; zero what no slot covers (the key slot) in the model's tensor."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

        metadata, prefix = self.metadata, fqn[: -len("in_proj_bias")]
        if metadata is None:  # set_up_planner asks only with metadata
            return
        described = {slot: metadata.state_dict_metadata.get(prefix + slot) for slot in _SLOTS}
        query = described["q_proj_bias"]
        if not isinstance(query, TensorStorageMetadata):
            return  # neither layout holds it: DefaultLoadPlanner says so as for any missing key
        width = tensor.shape[0] // 3
        chunks = []
        for position, (slot, stored) in enumerate(described.items()):
            if stored is None:
                _zero(tensor, position * width, width)
                continue
            info = next(info for index, info in metadata.storage_data.items() if index.fqn == prefix + slot)
            offsets = torch.Size([position * width])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([width])))
            metadata.storage_data[MetadataIndex(fqn, offsets, len(chunks) - 1)] = info
        metadata.state_dict_metadata[fqn] = TensorStorageMetadata(query.properties, torch.Size([3 * width]), chunks)


def _zero(tensor, start: int, length: int) -> None:
    """Zero ``tensor[start:start + length]`` of a plain tensor, or of the part a DTensor's rank holds."""
    with torch.no_grad():
        if not hasattr(tensor, "to_local"):
            tensor[start : start + length].zero_()
            return
        local = tensor.to_local()
        (chunk,) = tensor.__create_chunk_list__()  # DCP's own record of which rows this rank holds
        begin = max(start, chunk.offsets[0])
        end = min(start + length, chunk.offsets[0] + chunk.sizes[0])
        if begin < end:
            local[begin - chunk.offsets[0] : end - chunk.offsets[0]].zero_()
