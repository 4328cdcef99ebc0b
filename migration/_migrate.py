"""One migration run, in the order that keeps the input safe and the output whole.

1. Check the arguments and the destination (paths only, no reads).
2. Read the headers, find and check every attention module, plan each one; refuse before reading data:
   a shard from outside SRC, a tensor that expands far beyond its stored bytes, an output larger than
   the free space.
3. Compute the few rewritten biases; with ``verify``, compare each module before and after.
4. Copy the companion files and write every shard into a staging file or folder beside the
   destination (with ``verify``, read each file back and compare every tensor), sync it, and move it
   into place in one step (see :mod:`._staging`).

Nothing that is not ours is deleted or overwritten: see :mod:`._destination` for the rules.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch

from slim_mha.bias import FORMAT_VERSION

from ._checkpoint import INDEX_NAME, SINGLE_NAME, open_checkpoint, output_name, source_kind
from ._dcp import as_safetensors_shards
from ._dcp_writer import check_replaceable_dcp, planned_dcp_sizes
from ._destination import (
    COMPANIONS_KEY,
    Companion,
    check_destination,
    check_not_an_input,
    check_replaceable,
    find_companions,
    input_files,
)
from ._modules import AttentionGroup, find_attention_modules
from ._output import output_files, planned_sizes, write_output
from ._plan import MODES, ModulePlan, already_folded, keep_module, migrated_tensors, plan_module
from ._records import FLOAT_DTYPES, Checkpoint
from ._run_options import MigrationOptions
from ._staging import remove_litter
from ._verify import (
    check_module_error,
    module_output_error,
    tolerance_for,
)
from ._writer import OutputTensor
from ._zero_attn import check_patterns, matching_modules, records_zero_attn, zero_attn_modules
from .report import MigrationReport, ModuleReport, NothingToDo, format_size, option, plural, shown

# A torch file may hold a view that repeats a small storage (``expand``): written out, it takes its full
# size. More than this many times its stored bytes, plus the slack, asks for allow_expand.
_EXPANSION, _EXPANSION_SLACK = 4, 16 * 1024 * 1024


def inspect_source(source: str | os.PathLike, *, zero_attn: Iterable[str] = ()) -> MigrationReport:
    source = Path(source)
    zero_attn = check_patterns(zero_attn)
    with open_checkpoint(source) as checkpoint:
        groups = find_attention_modules(checkpoint)
        marked = zero_attn_modules(zero_attn, groups, checkpoint)
        recorded = records_zero_attn(checkpoint)
        modules = tuple(
            _module_report(group, group.name in marked, recorded=recorded, read=_reader(group)) for group in groups
        )
        checkpoint.check_unchanged()  # the figures shown are those of one version of each file
        return _report(checkpoint, "inspect", None, modules)


def migrate(
    mode: str, source: str | os.PathLike, destination: str | os.PathLike, options: MigrationOptions
) -> MigrationReport:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if options.fold_value_bias and mode == "to-stock":
        raise ValueError("fold_value_bias applies to strip and fold only; to-stock restores the stock layout")
    if options.to not in (None, "dcp", "safetensors"):
        raise ValueError(f"to must be None, 'dcp' or 'safetensors', got {options.to!r}")
    if (options.keep or options.keep_inexact) and mode != "strip":
        raise ValueError(
            f"{option('keep')} and {option('keep_inexact')} apply to strip only; {mode} converts every module it can"
        )
    source, destination = Path(source), Path(destination)
    if destination.name in ("", ".", ".."):  # "." names a folder whose staging must sit beside it, not in it
        destination = Path(os.path.abspath(destination))
    options = replace(options, zero_attn=check_patterns(options.zero_attn), keep=check_patterns(options.keep, "keep"))
    if not source.exists():
        raise FileNotFoundError(f"{shown(source)}: no such file or directory")
    kind = source_kind(source)
    if options.to == "dcp" and kind != "dcp":
        raise ValueError(
            f"{shown(source)}: is not a DCP folder, so the output is safetensors; leave out {option('to')}"
        )
    if kind in ("file", "torch") and destination.is_dir():  # as cp does: into the folder, under SRC's name
        destination = destination / output_name(source.name)
    if not destination.parent.resolve().is_dir() and not options.dry_run:
        raise FileNotFoundError(f"{shown(destination.parent)}: the folder for DST does not exist; create it first")
    # Before the checks: litter may hold the previous DST, moved aside by a run killed mid-replace.
    notes = () if options.dry_run else remove_litter(destination)
    check_destination(source, kind, destination, force=options.force, dry_run=options.dry_run)

    with open_checkpoint(source, follow_outside_links=options.follow_outside_links) as checkpoint:
        if checkpoint.kind == "dcp" and options.to == "safetensors":
            checkpoint = as_safetensors_shards(checkpoint, INDEX_NAME)
        return _migrate_opened(checkpoint, mode, destination, notes, options)


def _plans(checkpoint: Checkpoint, mode: str, options: MigrationOptions) -> list[ModulePlan]:
    """Every module's plan, each module that ``keep`` names or that strip cannot convert exactly kept
    as it is where asked; refused (nothing written) where a module cannot be converted exactly."""
    source = checkpoint.source
    groups = find_attention_modules(checkpoint)
    if not groups:
        raise NothingToDo(
            f"{shown(source)}: nothing to do: no attention modules found (no tensor named like in_proj_weight or "
            "q_proj_weight); nothing was written"
        )
    marked = zero_attn_modules(tuple(options.zero_attn), groups, checkpoint)
    kept = matching_modules(tuple(options.keep), groups, checkpoint, "keep")
    plans = []
    for group in groups:
        plan = plan_module(group, mode, zero_attn=group.name in marked, fold_value_bias=options.fold_value_bias)
        if group.name in kept:
            plan = keep_module(plan, f"{option('keep')}")
        elif plan.refusal and options.keep_inexact:
            plan = keep_module(plan, f"{option('keep_inexact')}: {plan.refusal}")
        plans.append(plan)
    refused = [plan for plan in plans if plan.refusal]
    if refused:
        first = refused[0]
        others = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        keep = f" (or pass {option('keep_inexact')} to strip the rest and leave such modules as they are)"
        raise ValueError(
            f"{shown(source)}: {mode} cannot convert '{shown(first.group.name)}'{others} exactly: "
            f"{first.refusal}{keep if mode == 'strip' else ''}; nothing was written"
        )
    return plans


def _migrate_opened(
    checkpoint: Checkpoint, mode: str, destination: Path, notes: tuple[str, ...], options: MigrationOptions
) -> MigrationReport:
    source = checkpoint.source
    if not options.allow_expand:
        _check_expansion(checkpoint)
    plans = _plans(checkpoint, mode, options)
    readers = {plan.group.prefix: _reader(plan.group) for plan in plans}  # each tensor read once in the run
    plans = [already_folded(plan, readers[plan.group.prefix]) for plan in plans]
    if not any(plan.changes for plan in plans):
        raise NothingToDo(f"{shown(source)}: nothing to do: {_unchanged(plans)}; nothing was written")

    recorded = records_zero_attn(checkpoint)
    rewritten: dict[str, dict[str, torch.Tensor]] = {}  # module prefix -> its new tensors by local name
    modules = []
    for plan in plans:
        read = readers.pop(plan.group.prefix)  # one module at a time: each of its tensors is read at most once
        tensors = migrated_tensors(plan, read) if plan.changes else {}
        error = _verify_module(plan, tensors, read) if options.verify and plan.changes else None
        rewritten[plan.group.prefix] = tensors
        modules.append(
            _module_report(plan.group, plan.zero_attn, recorded=recorded, plan=plan, verify_error=error, read=read)
        )
    outputs = output_files(checkpoint, plans, rewritten)
    written, write_notes, output_bytes, copied = _write_planned(checkpoint, mode, destination, plans, outputs, options)
    assumed = (
        tuple(module.name for module in modules if module.changed and module.zero_attn is None)
        if options.verify
        else ()
    )
    return _report(
        checkpoint,
        mode,
        destination,
        tuple(modules),
        output_tensors=sum(len(tensors) for _, tensors in outputs),
        output_bytes=output_bytes,
        dry_run=options.dry_run,
        written=not options.dry_run,
        verified=options.verify,
        files_read_back=len(written) if options.verify else 0,
        assumed_no_zero_attn=assumed,
        companions=tuple(companion.name for companion in copied),
        extra_notes=(*notes, *write_notes),
    )


def _metadata(mode: str, plans: list[ModulePlan]) -> dict[str, str]:
    """The run's provenance, written into every output file."""
    metadata = {"slim_mha.format_version": str(FORMAT_VERSION), "slim_mha.mode": mode}
    if any(plan.fold_value for plan in plans):
        metadata["slim_mha.value_bias_folded"] = "eval-only"
    zero_attn_names = sorted(plan.group.name for plan in plans if plan.zero_attn)
    if zero_attn_names:  # read back by the next run (zero_attn_modules), so a round trip keeps the mark
        metadata["slim_mha.zero_attn_modules"] = ",".join(zero_attn_names)
    return metadata


def _write_planned(
    checkpoint: Checkpoint,
    mode: str,
    destination: Path,
    plans: list[ModulePlan],
    outputs: list[tuple[str, list[OutputTensor]]],
    options: MigrationOptions,
) -> tuple[dict[str, int], tuple[str, ...], int, list[Companion]]:
    """Check the destination and the free space, then write (or, in a dry run, check SRC once more).
    Returns the written sizes, notes, the output's bytes and the companions copied."""
    metadata = _metadata(mode, plans)
    found, skipped = find_companions(checkpoint, follow_outside_links=options.follow_outside_links)
    copied = found if options.companions else []
    notes: tuple[str, ...] = tuple(skipped)
    if found and not options.companions:
        notes = (f"did not copy {plural(len(found), 'companion file')} ({option('no_companions')})",)
    writes = {name for name, _ in outputs} | ({checkpoint.output_index_name} if checkpoint.kind == "sharded" else set())
    writes |= {companion.name for companion in copied}
    reads = input_files(checkpoint, found)
    # A DCP folder keeps its format: its own files, sizes and replacement rule (see ._dcp_writer).
    placed_at = {
        plan.group.key(local): plan.group.key(source) for plan in plans for local, source in plan.placed.items()
    }
    writes_dcp = checkpoint.kind == "dcp"

    def check() -> None:
        if writes_dcp:
            check_not_an_input(destination, reads)
            check_replaceable_dcp(destination)
            return
        check_replaceable(
            destination, directory=checkpoint.writes_directory, writes=writes, reads=reads, companions=copied
        )

    check()
    # The sizes the files will have on disk; a companion record of the same length stands in for the
    # digests, which are known only once the files are copied.
    placeholder = {companion.name: "0" * 64 for companion in copied}
    if writes_dcp:
        sizes = planned_dcp_sizes(checkpoint, outputs, placed_at, metadata, placeholder, destination)
    else:
        sizes = planned_sizes(checkpoint, outputs, metadata, placeholder)
    output_bytes = sum(sizes.values())
    _check_free_space(destination, output_bytes + sum(companion.size for companion in copied))
    if options.dry_run:
        checkpoint.check_unchanged()  # what the dry run planned and verified is what SRC holds
        if not destination.parent.resolve().is_dir():
            notes += (f"{shown(destination.parent)} does not exist yet: create it before the real run",)
        return {}, notes, output_bytes, copied
    written, write_notes = write_output(
        checkpoint, destination, outputs, metadata, copied, options, check=check, placed_at=placed_at
    )
    return written, write_notes + notes, sum(written.values()), copied


def _check_expansion(checkpoint: Checkpoint) -> None:
    """Refuse a torch file whose tensors, written out, would take far more than the file stores."""
    for shard in checkpoint.shards:
        for record in shard.records.values():
            if record.stored is not None and record.nbytes > _EXPANSION * record.stored + _EXPANSION_SLACK:
                raise ValueError(
                    f"{shown(shard.path)}: '{shown(record.key)}' would take {format_size(record.nbytes)} once "
                    f"written but stores {format_size(record.stored)} (an expanded view of a smaller tensor); "
                    f"pass {option('allow_expand')} if that is intended"
                )
        if any(record.stored is not None for record in shard.records.values()):
            size = shard.opened.size
            if shard.nbytes > _EXPANSION * size + _EXPANSION_SLACK:
                raise ValueError(
                    f"{shown(shard.path)}: its tensors would take {format_size(shard.nbytes)} once written but the "
                    f"file is {format_size(size)} (views that repeat the same data); pass "
                    f"{option('allow_expand')} if that is intended"
                )


def _check_free_space(destination: Path, needed: int) -> None:
    """Refuse before writing when the output cannot fit: a full disk found halfway costs the time."""
    folder = destination.parent
    while not folder.exists() and folder != folder.parent:  # a dry run may plan into a folder not made yet
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        error = OSError(
            f"{shown(destination)}: the output needs {format_size(needed)} but its file system has "
            f"{format_size(free)} free; free some space or choose another DST; nothing was written"
        )
        error.errno = errno.ENOSPC
        raise error


# ----------------------------------------------------------------------------------- arguments


def _unchanged(plans: list[ModulePlan]) -> str:
    """Why no module changes, in the words of each plan's action (those inspect prints)."""
    state = "stock" if plans[0].mode == "to-stock" else "slim"
    # The words in a plan's action that give its reason, and the reason for one module and for several.
    reasons = {
        "already zero": ("has its key slot at zero already", "have their key slots at zero already"),
        "already": (f"is already in the {state} layout", f"are already in the {state} layout"),
        "add_zero_attn": ("keeps its key bias (add_zero_attn)", "keep their key bias (add_zero_attn)"),
        "no input bias": ("has no input biases (bias=False)", "have no input biases (bias=False)"),
    }
    counts = dict.fromkeys(reasons, 0)
    for plan in plans:
        counts[next((words for words in reasons if words in plan.action), "already")] += 1
    found = [(count, reasons[words]) for words, count in counts.items() if count]
    if len(plans) == 1:
        return f"its attention module '{shown(plans[0].group.name)}' {found[0][1][0]}"
    if counts["no input bias"] == len(plans):
        return f"none of its {len(plans)} attention modules has input biases (bias=False)"
    if len(found) == 1:
        return f"all {len(plans)} attention modules {found[0][1][1]}"
    parts = [f"{count} {one if count == 1 else several}" for count, (one, several) in found]
    return f"of its {len(plans)} attention modules, " + " and ".join(parts)


# ------------------------------------------------------------------------------------ per module


def _reader(group: AttentionGroup) -> Callable[[str], torch.Tensor]:
    """``read(local)``: the module's tensor, read from disk on first use only. Planning, verifying and
    reporting all ask for the same few tensors; reading each once keeps a run linear in its tensors."""
    cache: dict[str, torch.Tensor] = {}

    def read(local: str) -> torch.Tensor:
        if local not in cache:
            cache[local] = group.records[local].read()
        return cache[local]

    return read


def _verify_module(plan: ModulePlan, rewritten: dict, read: Callable[[str], torch.Tensor]) -> float:
    group = plan.group
    kept = {local: record for local, record in group.records.items() if local not in plan.removed}
    tolerance, dtype = tolerance_for(
        [FLOAT_DTYPES[kept[local].dtype] for local in kept if local not in rewritten]
        + [tensor.dtype for tensor in rewritten.values()]
    )
    original = {local: read(local).to(torch.float64) for local in group.records}
    migrated = {local: original[local] for local in kept}
    migrated.update(rewritten)
    error = module_output_error(
        original, migrated, embed_dim=group.embed_dim, kdim=group.kdim, vdim=group.vdim, zero_attn=plan.zero_attn
    )
    where = str(group.records["out_proj.weight"].shard.path)
    check_module_error(error, tolerance, module=group.name, where=where, dtype=dtype)
    return error


def _module_report(
    group: AttentionGroup,
    zero_attn: bool,
    *,
    recorded: bool,
    read: Callable[[str], torch.Tensor],
    plan: ModulePlan | None = None,
    verify_error: float | None = None,
) -> ModuleReport:
    actions = {mode: plan_module(group, mode, zero_attn=zero_attn).action for mode in MODES}
    key_bias, key_bias_max = _key_bias(group, read)
    return ModuleReport(
        name=group.name,
        layout=group.layout,
        embed_dim=group.embed_dim,
        kdim=group.kdim,
        vdim=group.vdim,
        dtype=group.dtype,
        shapes=tuple((local, record.shape) for local, record in group.sorted_records()),
        key_bias=key_bias,
        key_bias_max=key_bias_max,
        bias_kv=group.has_bias_kv,
        # Known when marked, when a slim module keeps k_proj_bias (only add_zero_attn does) or lacks it,
        # or when slim_mha wrote the checkpoint and recorded its marks; a stock module cannot say.
        zero_attn=True if zero_attn or "k_proj_bias" in group else (False if recorded or group.is_slim else None),
        strip=actions["strip"],
        fold=actions["fold"],
        to_stock=actions["to-stock"],
        action=plan.action if plan else None,
        changed=bool(plan and plan.changes),
        verify_error=verify_error,
    )


def _key_bias(group: AttentionGroup, read: Callable[[str], torch.Tensor]) -> tuple[str, float | None]:
    if "in_proj_bias" in group:
        embed_dim = group.embed_dim
        key_bias = read("in_proj_bias")[embed_dim : 2 * embed_dim]
    elif "k_proj_bias" in group:
        key_bias = read("k_proj_bias")
    else:
        return ("dropped" if group.is_slim else "absent"), None
    largest = float(key_bias.float().abs().max())
    return ("zero" if largest == 0 else "non-zero"), largest


# ------------------------------------------------------------------------------------ the output


def _report(
    checkpoint: Checkpoint, mode: str, destination: Path | None, modules, extra_notes=(), **fields
) -> MigrationReport:
    records = checkpoint.records
    metadata = dict(checkpoint.shards[0].metadata) if checkpoint.shards else {}
    metadata.pop(COMPANIONS_KEY, None)  # bookkeeping for a later force run, not the model's metadata
    return MigrationReport(
        mode=mode,
        source=checkpoint.source,
        destination=destination,
        shards=tuple(shard.name for shard in checkpoint.shards),
        tensors=len(records),
        total_bytes=sum(opened.size for opened in checkpoint.files),  # on disk, as ls and du count them
        modules=modules,
        metadata=metadata,
        notes=(*checkpoint.notes, *extra_notes),
        **fields,
    )


__all__ = ["FORMAT_VERSION", "INDEX_NAME", "SINGLE_NAME", "MigrationOptions", "inspect_source", "migrate"]
