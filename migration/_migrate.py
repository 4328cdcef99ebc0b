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
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from slim_mha.bias import FORMAT_VERSION

from ._checkpoint import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    INDEX_NAME,
    SINGLE_NAME,
    Checkpoint,
    open_checkpoint,
    output_name,
    source_kind,
)
from ._destination import (
    COMPANIONS_KEY,
    Companion,
    check_destination,
    check_replaceable,
    companion_record,
    file_digest,
    find_companions,
    input_files,
    output_permissions,
    permissions,
)
from ._inputs import open_input
from ._modules import AttentionGroup, find_attention_modules
from ._plan import MODES, ModulePlan, already_folded, keep_module, migrated_tensors, plan_module
from ._staging import Staging, pause_for_tests, remove_litter, sync_files
from ._verify import (
    check_module_error,
    check_written_file,
    check_written_text,
    module_output_error,
    tolerance_for,
)
from ._writer import OutputTensor, copy_file, planned_size, write_safetensors
from ._zero_attn import check_patterns, matching_modules, records_zero_attn, zero_attn_modules
from .report import MigrationReport, ModuleReport, NothingToDo, format_size, option, plural, shown

_PROGRESS_BYTES = 256 * 1024 * 1024  # a single file this large gets a progress bar too
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


@dataclass(frozen=True)
class MigrationOptions:
    """The options of one run, carried whole from the public functions to the writer (their meaning:
    :func:`slim_mha.migration.strip_checkpoint`)."""

    zero_attn: Iterable[str] = ()  # checked and made a tuple by migrate
    fold_value_bias: bool = False
    verify: bool = False
    dry_run: bool = False
    force: bool = False
    companions: bool = True
    progress: bool | None = None
    follow_outside_links: bool = False
    allow_expand: bool = False
    keep: Iterable[str] = ()  # strip: modules left as they are, by name or glob pattern
    keep_inexact: bool = False  # strip: leave as they are the modules it cannot convert exactly


def migrate(
    mode: str, source: str | os.PathLike, destination: str | os.PathLike, options: MigrationOptions
) -> MigrationReport:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if options.fold_value_bias and mode == "to-stock":
        raise ValueError("fold_value_bias applies to strip and fold only; to-stock restores the stock layout")
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
    if kind in ("file", "torch") and destination.is_dir():  # as cp does: into the folder, under SRC's name
        destination = destination / output_name(source.name)
    if not destination.parent.resolve().is_dir() and not options.dry_run:
        raise FileNotFoundError(f"{shown(destination.parent)}: the folder for DST does not exist; create it first")
    # Before the checks: litter may hold the previous DST, moved aside by a run killed mid-replace.
    notes = () if options.dry_run else remove_litter(destination)
    check_destination(source, kind, destination, force=options.force, dry_run=options.dry_run)

    with open_checkpoint(source, follow_outside_links=options.follow_outside_links) as checkpoint:
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
    outputs = _output_files(checkpoint, plans, rewritten)
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

    def check() -> None:
        check_replaceable(
            destination, directory=checkpoint.writes_directory, writes=writes, reads=reads, companions=copied
        )

    check()
    # The sizes the files will have on disk; a companion record of the same length stands in for the
    # digests, which are known only once the files are copied.
    placeholder = {companion.name: "0" * 64 for companion in copied}
    output_bytes = sum(_planned_sizes(checkpoint, outputs, metadata, placeholder).values())
    _check_free_space(destination, output_bytes + sum(companion.size for companion in copied))
    if options.dry_run:
        checkpoint.check_unchanged()  # what the dry run planned and verified is what SRC holds
        if not destination.parent.resolve().is_dir():
            notes += (f"{shown(destination.parent)} does not exist yet: create it before the real run",)
        return {}, notes, output_bytes, copied
    written, write_notes = _write_output(checkpoint, destination, outputs, metadata, copied, options, check=check)
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


def _planned_sizes(
    checkpoint: Checkpoint,
    outputs: list[tuple[str, list[OutputTensor]]],
    provenance: dict[str, str],
    digests: dict[str, str],
) -> dict[str, int]:
    """Each output file's size on disk (shards and index), as :func:`_write_output` writes them."""
    shards = {shard.name: shard for shard in checkpoint.shards}
    sizes = {
        name: planned_size(tensors, _file_metadata(checkpoint, shards[name], provenance, digests))
        for name, tensors in outputs
    }
    if checkpoint.kind == "sharded":
        sizes[checkpoint.output_index_name] = len(_index_text(checkpoint, outputs, provenance, digests).encode("utf-8"))
    return sizes


def _file_metadata(checkpoint: Checkpoint, shard, provenance: dict[str, str], digests: dict[str, str]) -> dict:
    """A shard's metadata: the source's, the run's provenance, and, in the one file that stands for the
    output folder (its single model.safetensors; else the index), the record of its companion files."""
    metadata = {**shard.metadata, **provenance}
    metadata.pop(COMPANIONS_KEY, None)
    if digests and checkpoint.kind == "directory":
        metadata[COMPANIONS_KEY] = companion_record(digests)
    return metadata


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


def _output_files(
    checkpoint: Checkpoint, plans: list[ModulePlan], rewritten: dict[str, dict[str, torch.Tensor]]
) -> list[tuple[str, list[OutputTensor]]]:
    """Each output file's name and tensors: the input's shards, minus dropped keys, plus new ones."""
    replaced: set[str] = set()
    added: dict[str, list[OutputTensor]] = {shard.name: [] for shard in checkpoint.shards}
    for plan in plans:
        group, tensors = plan.group, rewritten[plan.group.prefix]
        replaced.update(group.key(local) for local in plan.removed)
        for local, tensor in tensors.items():
            replaced.add(group.key(local))
            home = group.records[plan.placed[local]].shard.name
            nbytes = tensor.numel() * tensor.element_size()
            added[home].append(
                OutputTensor(group.key(local), DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), nbytes, tensor=tensor)
            )
    files = []
    for shard in checkpoint.shards:
        kept = [
            OutputTensor(record.key, record.dtype, record.shape, record.nbytes, record=record)
            for key, record in shard.records.items()
            if key not in replaced
        ]
        if kept or added[shard.name]:
            files.append((shard.name, kept + added[shard.name]))
    return files


def _write_output(
    checkpoint: Checkpoint,
    destination: Path,
    files: list[tuple[str, list[OutputTensor]]],
    provenance: dict[str, str],
    companions: list[Companion],
    options: MigrationOptions,
    *,
    check: Callable[[], None],
) -> tuple[dict[str, int], tuple[str, ...]]:
    """Write the output into a staging path and move it into place; on any failure, including an
    interruption, the staging path is removed and DST is left as it was. Returns each written file's
    size on disk (shards and index), and notes for the report."""
    total = sum(tensor.nbytes for _, tensors in files for tensor in tensors)
    total += sum(companion.size for companion in companions)
    progress = options.progress
    if progress is None:
        progress = sys.stderr.isatty() and (len(files) > 1 or total >= _PROGRESS_BYTES)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=checkpoint.source.name,
        file=sys.stderr,
        disable=not progress,
    )
    # cp -p: each file keeps its source's permission bits, the folder its source folder's (a replaced
    # DST its own, less any the source lacks), whatever the umask.
    folder_source = checkpoint.source if checkpoint.source.is_dir() else checkpoint.source.parent
    if checkpoint.writes_directory:
        mode = output_permissions(permissions(folder_source), destination, force=options.force)
    else:
        mode = output_permissions(checkpoint.shards[0].opened.mode, destination, force=options.force)
    staging = Staging(destination, directory=checkpoint.writes_directory, mode=mode)
    try:
        with staging:
            # Companions first: the record of their digests goes into the files written after them.
            root = Path(os.path.realpath(folder_source))
            digests = _copy_companions(staging.path, destination, companions, root, options, bar)
            sizes = _write_files(checkpoint, staging.path, destination, files, provenance, digests, mode, options, bar)
            pause_for_tests("before-commit")
            checkpoint.check_unchanged()  # after the last read of SRC (verify's included): one version of each
            staging.commit(replace=options.force or _is_empty_directory(destination), check=check)
            pause_for_tests("after-commit")
        return sizes, tuple(staging.notes)
    except OSError as exc:
        if isinstance(exc, FileExistsError) or exc.filename is None and exc.errno is None:
            raise  # already names the user's path
        raise _write_error(exc, destination, staging) from None
    finally:
        bar.close()


def _copy_companions(
    staging: Path, destination: Path, companions: list[Companion], root: Path, options: MigrationOptions, bar
) -> dict[str, str]:
    """Copy each companion file into the staging folder; returns their digests."""
    digests = {}
    for companion in companions:
        bar.set_postfix_str(companion.name, refresh=False)
        target = staging / companion.name
        # Opened and judged again: the listing is only where to look; the opened file is what is copied.
        opened = open_input(companion.path, root, follow_outside_links=options.follow_outside_links)
        try:
            digests[companion.name] = copy_file(opened, target, bar.update, mode=opened.mode)
        finally:
            opened.close()
        if options.verify and file_digest(target) != digests[companion.name]:
            raise RuntimeError(
                f"{shown(destination / companion.name)}: {option('verify')} read the copied file back and it "
                f"differs from {shown(companion.path)}; nothing was written"
            )
    sync_files(staging, [companion.name for companion in companions])
    return digests


def _write_files(
    checkpoint: Checkpoint,
    staging: Path,
    destination: Path,
    files: list[tuple[str, list[OutputTensor]]],
    provenance: dict[str, str],
    digests: dict[str, str],
    mode: int,
    options: MigrationOptions,
    bar,
) -> dict[str, int]:
    """Write every shard (and a sharded checkpoint's index) into the staging path; their sizes."""
    shards = {shard.name: shard for shard in checkpoint.shards}
    sizes: dict[str, int] = {}
    for number, (name, tensors) in enumerate(files):
        path, final = (staging / name, destination / name) if checkpoint.writes_directory else (staging, destination)
        file_mode = mode if not checkpoint.writes_directory else shards[name].opened.mode
        bar.set_postfix_str(name, refresh=False)
        metadata = _file_metadata(checkpoint, shards[name], provenance, digests)
        sizes[name] = write_safetensors(path, tensors, metadata, bar.update, shown_as=final, mode=file_mode)
        if number == 0:
            pause_for_tests("after-first-shard")
        if options.verify:
            check_written_file(path, tensors, shown_as=final)
    if checkpoint.kind == "sharded":
        text = _index_text(checkpoint, files, provenance, digests)
        index = staging / checkpoint.output_index_name
        _write_index(index, text, checkpoint.opened_index.mode)
        sizes[checkpoint.output_index_name] = len(text.encode("utf-8"))
        if options.verify:
            check_written_text(index, text, shown_as=destination / checkpoint.output_index_name)
    return sizes


def _write_error(exc: OSError, destination: Path, staging: Staging) -> OSError:
    """A failed write, said in one line that names DST and what state it is in."""
    if staging.committed:
        state = f"{shown(destination)} was written completely, but syncing its folder failed"
    elif os.path.lexists(destination):
        state = f"{shown(destination)} was left as it was"
    else:
        state = "nothing was written"
    reason = exc.strerror or str(exc)
    culprit = os.fspath(exc.filename) if exc.filename is not None else None
    if culprit and not culprit.startswith(os.fspath(staging.path)):  # an input, named as the user named it
        reason = f"{shown(culprit)}: {reason}"
    error = OSError(f"{shown(destination)}: cannot write the output ({reason}); {state}")
    error.errno = exc.errno
    return error


def _is_empty_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not os.listdir(path)


def _index_text(
    checkpoint: Checkpoint,
    files: list[tuple[str, list[OutputTensor]]],
    provenance: dict[str, str],
    digests: dict[str, str],
) -> str:
    weight_map = {tensor.key: name for name, tensors in files for tensor in tensors}
    total_size = sum(tensor.nbytes for _, tensors in files for tensor in tensors)
    metadata = {**checkpoint.index_metadata, **provenance, "total_size": total_size}
    metadata.pop(COMPANIONS_KEY, None)
    if digests:
        metadata[COMPANIONS_KEY] = companion_record(digests)
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2) + "\n"


def _write_index(path: Path, text: str, mode: int) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(descriptor, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fchmod(file.fileno(), mode)
        os.fsync(file.fileno())


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
