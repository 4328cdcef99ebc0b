"""Writing a migrated DCP folder that ``dcp.load`` reads, with the source's data files copied byte for byte.

Each data file of SRC becomes the data file of the same name in DST: the byte ranges of every entry
that is kept (chunks of unchanged tensors, non-tensor entries) are copied, in the kernel where it can,
and the rewritten tensors of the modules that file held come after them, each one whole chunk (a
``torch.save`` blob, as DCP writes them). No byte of a dropped or rewritten tensor is copied: a stripped
key bias is not in DST's files. The metadata is SRC's with the entries, chunks and byte ranges of DST;
``dcp.load`` reshards whole chunks to whatever sharding it loads into. The run's provenance goes into
``slim_mha.json`` beside them. Memory: the rewritten tensors, and one copy buffer.

:mod:`._output` writes it into a staging folder beside DST, with the companion files, and moves it
into place in one step (:mod:`._staging`); with ``verify`` every entry is read back from the staging
folder first.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from slim_mha._torch_compat import dcp_storage_info

from ._dcp import METADATA_NAME, PROVENANCE_NAME, DcpEntries, DcpRecord, read_metadata
from ._destination import COMPANIONS_KEY, OURS_KEY, companion_record, file_digest
from ._inputs import open_input
from ._records import DTYPE_NAMES, Checkpoint
from ._run_options import MigrationOptions
from ._staging import pause_for_tests, sync_files
from ._writer import OutputTensor, copy_range, write_at
from .report import option, shown

__all__ = ["check_replaceable_dcp", "planned_dcp_sizes", "write_dcp_files"]

_BUFFER = 1024 * 1024
DATA_FILES_KEY = "slim_mha.data_files"  # slim_mha.json: the data files this tool wrote into the folder


@dataclasses.dataclass
class _Plan:
    """DST's data files (each: SRC's items kept, then the new tensors as blobs) and its metadata's parts."""

    kept: dict[str, list] = dataclasses.field(default_factory=dict)  # file -> [(MetadataIndex, storage)]
    blobs: dict[str, list[tuple[str, Tensor, bytes]]] = dataclasses.field(default_factory=dict)  # file -> new
    replaced_by: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # SRC fqn -> DST fqns in its place


def _plan(checkpoint: Checkpoint, files: list[tuple[str, list[OutputTensor]]], placed_at: dict[str, str]) -> _Plan:
    entries = _entries(checkpoint)
    output_keys = {tensor.key for _, tensors in files for tensor in tensors if tensor.record is not None}
    dropped = set(checkpoint.records) - output_keys
    plan = _Plan(kept={name: [] for name in entries.data_files}, blobs={name: [] for name in entries.data_files})
    for fqn, items in entries.items.items():
        if fqn not in dropped:
            for index, info in items:
                plan.kept[info.relative_path].append((index, info))
    for items in plan.kept.values():
        items.sort(key=lambda item: item[1].offset)  # SRC's order: runs of bytes the kernel copies in one go
    for name, tensors in files:
        for tensor in tensors:
            if tensor.tensor is None:
                continue
            buffer = io.BytesIO()
            torch.save(tensor.tensor, buffer)
            plan.blobs[name].append((tensor.key, tensor.tensor, buffer.getvalue()))
            plan.replaced_by.setdefault(placed_at[tensor.key], []).append(tensor.key)
    return plan


def _entries(checkpoint: Checkpoint) -> DcpEntries:
    if not isinstance(checkpoint.entries, DcpEntries):
        raise RuntimeError(f"{checkpoint.source}: not opened as a DCP folder")
    return checkpoint.entries


def _metadata(checkpoint: Checkpoint, plan: _Plan, offsets: dict[str, dict], destination: Path):
    """DST's metadata: SRC's, each entry where its bytes now are; new tensors in place of those they replace."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    source: Any = _entries(checkpoint).metadata  # DCP's Metadata, of the torch that reads it
    described, planner, storage = {}, {}, {}
    planner_data = source.planner_data if isinstance(source.planner_data, dict) else {}
    new_blobs = {fqn: tensor for blobs in plan.blobs.values() for fqn, tensor, _ in blobs}
    for fqn, entry in source.state_dict_metadata.items():
        for new in plan.replaced_by.get(fqn, []):
            tensor = new_blobs[new]
            properties = dataclasses.replace(entry.properties, dtype=tensor.dtype)
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.size())
            described[new] = TensorStorageMetadata(properties=properties, size=tensor.size(), chunks=[chunk])
            planner[new] = _renamed_path(planner_data.get(fqn), fqn, new)
        if fqn in offsets["kept"] or fqn not in checkpoint.records:
            described[fqn] = entry
            if fqn in planner_data:
                planner[fqn] = planner_data[fqn]
    for (index, info), offset in offsets["items"]:
        storage[index] = type(info)(info.relative_path, offset, info.length)
    for fqn, (name, offset, length) in offsets["blobs"].items():
        tensor = new_blobs[fqn]
        storage[MetadataIndex(fqn, torch.Size([0] * tensor.dim()), 0)] = dcp_storage_info(name, offset, length)
    fields = {"state_dict_metadata": described, "planner_data": planner, "storage_data": storage}
    storage_meta = getattr(source, "storage_meta", None)  # where DST is, for a reader that asks; newer DCP only
    if storage_meta is not None and hasattr(storage_meta, "checkpoint_id"):
        fields["storage_meta"] = dataclasses.replace(storage_meta, checkpoint_id=destination)
    return dataclasses.replace(source, **fields)


def _renamed_path(path, fqn: str, new: str):
    """The nested-dict path DCP unflattens ``new`` to: ``fqn``'s, with its last name renamed as the key's
    is (``in_proj_bias`` to ``q_proj_bias``: the attention biases' names hold no dot)."""
    if new == fqn:
        return path if path is not None else (new,)
    (module, _, old_name), (new_module, _, new_name) = fqn.rpartition("."), new.rpartition(".")
    if module != new_module or not isinstance(path, tuple) or not path or not str(path[-1]).endswith(old_name):
        return (new,)
    return (*path[:-1], path[-1][: len(path[-1]) - len(old_name)] + new_name)


def _layout(plan: _Plan) -> dict:
    """Where every kept item and new blob lands in DST's files, and each file's size."""
    layout: dict = {"items": [], "blobs": {}, "sizes": {}, "kept": set()}  # blobs: fqn -> (file, offset, length)
    for name, items in plan.kept.items():
        offset = 0
        for index, info in items:
            layout["items"].append(((index, info), offset))
            layout["kept"].add(index.fqn)
            offset += info.length
        for fqn, _, blob in plan.blobs[name]:
            layout["blobs"][fqn] = (name, offset, len(blob))
            offset += len(blob)
        layout["sizes"][name] = offset
    return layout


def _provenance_text(provenance: dict[str, str], digests: dict[str, str], layout: dict) -> str:
    """``slim_mha.json``: the run's provenance, the companions' digests, and the data files it writes:
    what a later ``--force`` run may replace (:func:`check_replaceable_dcp`)."""
    recorded = dict(provenance)
    if digests:
        recorded[COMPANIONS_KEY] = companion_record(digests)
    recorded[DATA_FILES_KEY] = json.dumps(sorted(name for name, size in layout["sizes"].items() if size))
    return json.dumps(recorded, indent=2, sort_keys=True) + "\n"


def planned_dcp_sizes(
    checkpoint: Checkpoint,
    files: list[tuple[str, list[OutputTensor]]],
    placed_at: dict[str, str],
    provenance: dict[str, str],
    digests: dict[str, str],
    destination: Path,
) -> dict[str, int]:
    """Each file DST will hold and its size, as :func:`write_dcp_files` writes them."""
    plan = _plan(checkpoint, files, placed_at)
    layout = _layout(plan)
    sizes = {name: size for name, size in layout["sizes"].items() if size}
    sizes[METADATA_NAME] = len(pickle.dumps(_metadata(checkpoint, plan, layout, destination)))
    sizes[PROVENANCE_NAME] = len(_provenance_text(provenance, digests, layout).encode("utf-8"))
    return sizes


def write_dcp_files(
    checkpoint: Checkpoint,
    staging: Path,
    destination: Path,
    files: list[tuple[str, list[OutputTensor]]],
    placed_at: dict[str, str],
    provenance: dict[str, str],
    digests: dict[str, str],
    options: MigrationOptions,
    advance: Callable[[int], object],
) -> dict[str, int]:
    """Write DST's files (see the module's docstring) into the staging folder; their sizes."""
    plan = _plan(checkpoint, files, placed_at)
    layout = _layout(plan)
    entries = _entries(checkpoint)
    sizes: dict[str, int] = {}
    buffer = bytearray(_BUFFER)
    places = {index: offset for (index, _), offset in layout["items"]}
    for number, (name, items) in enumerate(plan.kept.items()):
        if not layout["sizes"][name]:
            continue  # every entry of this file was dropped or rewritten
        source = entries.data_files[name]
        target = os.open(staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for index, info in items:
                copy_range(
                    source.descriptor,
                    info.offset,
                    target,
                    places[index],
                    info.length,
                    buffer,
                    advance,
                    source_path=source.path,
                )
            for fqn, _, blob in plan.blobs[name]:
                write_at(target, blob, layout["blobs"][fqn][1])
                advance(len(blob))
            os.fchmod(target, source.mode)
        finally:
            os.close(target)
        sizes[name] = layout["sizes"][name]
        if number == 0:
            pause_for_tests("after-first-shard")
    metadata = _metadata(checkpoint, plan, layout, destination)
    sizes[METADATA_NAME] = _write_file(staging / METADATA_NAME, pickle.dumps(metadata), checkpoint.opened_index.mode)
    text = _provenance_text(provenance, digests, layout).encode("utf-8")
    sizes[PROVENANCE_NAME] = _write_file(staging / PROVENANCE_NAME, text, checkpoint.opened_index.mode)
    sync_files(staging, list(sizes))
    if options.verify:
        _verify(checkpoint, plan, set(metadata.state_dict_metadata), staging, destination)
    return sizes


def _write_file(path: Path, data: bytes, mode: int) -> int:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        write_at(descriptor, data, 0)
        os.fchmod(descriptor, mode)
    finally:
        os.close(descriptor)
    return len(data)


def _verify(checkpoint: Checkpoint, plan: _Plan, entries_planned: set[str], staging: Path, destination: Path) -> None:
    """Read DST back from the staging folder and compare it with what was planned: its metadata as DCP
    reads it, every copied entry's bytes with SRC's (block by block), every new tensor with its value."""

    def fail(problem: str) -> RuntimeError:
        return RuntimeError(
            f"{shown(destination)}: {option('verify')} read DST back and {problem}; nothing was written"
        )

    entries = _entries(checkpoint)
    names = [name for name in (METADATA_NAME, *plan.kept) if (staging / name).exists()]
    opened = {name: open_input(staging / name, None) for name in names}
    try:
        written = read_metadata(opened[METADATA_NAME])
        if set(written.state_dict_metadata) != entries_planned:
            raise fail("its entries differ from those planned")
        sources = {(index.fqn, _offsets(index)): info for items in entries.items.values() for index, info in items}
        new = {fqn: tensor for blobs in plan.blobs.values() for fqn, tensor, _ in blobs}
        buffers = bytearray(_BUFFER), bytearray(_BUFFER)
        for index, info in written.storage_data.items():
            if index.fqn in new:
                tensor = new[index.fqn]
                record = DcpRecord(
                    index.fqn,
                    DTYPE_NAMES[tensor.dtype],
                    tuple(tensor.shape),
                    0,
                    checkpoint.shards[0],
                    data_files=opened,
                )
                if not torch.equal(record.read_chunk(info), tensor):
                    raise fail(f"'{shown(index.fqn)}' differs from its conversion")
            elif not _same_bytes(
                opened[info.relative_path], info, entries.data_files, sources[(index.fqn, _offsets(index))], buffers
            ):
                raise fail(f"'{shown(index.fqn)}' differs from SRC's bytes")
    finally:
        for file in opened.values():
            file.close()


def _offsets(index) -> tuple | None:
    return None if index.offset is None else tuple(index.offset)


def _same_bytes(target, info, source_files, source_info, buffers) -> bool:
    if info.length != source_info.length:
        return False
    source = source_files[source_info.relative_path]
    done = 0
    while done < info.length:
        step = min(_BUFFER, info.length - done)
        ours = os.preadv(target.descriptor, [memoryview(buffers[0])[:step]], info.offset + done)
        theirs = os.preadv(source.descriptor, [memoryview(buffers[1])[:step]], source_info.offset + done)
        if ours != step or theirs != step or buffers[0][:step] != buffers[1][:step]:
            return False
        done += step
    return True


def check_replaceable_dcp(destination: Path) -> None:
    """With ``--force``, DST may be replaced only if it is a DCP folder this tool wrote (its
    ``slim_mha.json`` says so) holding nothing but what that record names: its metadata, the data files
    it wrote, and the companions it copied, unchanged since (by digest). Anything else is named, not
    deleted: a data file someone added, a companion someone edited."""
    if not os.path.lexists(destination) or (destination.is_dir() and not os.listdir(destination)):
        return
    recorded = _recorded(destination / PROVENANCE_NAME)
    if OURS_KEY not in recorded:
        raise ValueError(
            f"{shown(destination)}: {option('force')} replaces only a DCP folder slim-mha-migrate wrote, and this one "
            f"has no {PROVENANCE_NAME} of ours (someone else's checkpoint?); move it away or choose another DST"
        )
    companions, data_files = _listed(recorded, COMPANIONS_KEY), _listed(recorded, DATA_FILES_KEY)
    for name in sorted(os.listdir(destination)):
        path = destination / name
        if name in companions:
            ours = isinstance(companions, dict) and companions[name] == file_digest(path)
        else:
            ours = name in (METADATA_NAME, PROVENANCE_NAME) or name in data_files
        if not ours:
            raise ValueError(
                f"{shown(path)}: {option('force')} would delete it with DST, and no earlier run wrote it, or it "
                "changed since; move it away or choose another DST"
            )


def _recorded(path: Path) -> dict:
    """An earlier output's ``slim_mha.json``, or ``{}`` where there is none that reads as one."""
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def _listed(recorded: dict, key: str) -> dict | list:
    """The names (a list, or a dict of name to digest) under ``key``, each a string; empty if malformed."""
    try:
        listed = json.loads(recorded.get(key, "[]"))
    except (TypeError, ValueError, RecursionError):
        return []
    if isinstance(listed, dict):
        return {name: digest for name, digest in listed.items() if isinstance(digest, str)}
    return [name for name in listed if isinstance(name, str)] if isinstance(listed, list) else []
