"""Migration speed against copying the files, and peak memory against the largest shard.

Builds a synthetic sharded stock checkpoint of transformer layers (default 1 GiB in 4 shards) in a
temporary directory, then, interleaved over ``--repeats`` rounds:

* ``cp -r SRC DST`` (the baseline the issue names), and the same followed by an fsync of each copied
  file, of DST and of its folder (what fold does before it reports success),
* ``fold_checkpoint(SRC, DST)`` in this process (migration alone),
* ``python -m slim_mha.migration fold SRC DST --quiet`` (end to end, including Python and torch start-up),
* ``python -c "import slim_mha.migration.cli, slim_mha.migration._migrate"`` (that start-up alone:
  a fixed cost, whatever the size).

Dirty pages are flushed (``os.sync``) between runs, outside the timings. The source stays in the page
cache for all of them, so each reads from memory; ``cp -r`` only writes to the page cache, while fold
and ``cp -r + fsync`` also wait for the disk.

Peak memory: each command runs in a fresh child that imports everything first, then resets the
kernel's peak-RSS mark (``/proc/self/clear_refs``) and reports its peak (``VmHWM``) minus its RSS at
that point: the memory the migration itself took, with the import-time peak of torch excluded.

Many tensors (issue 11): single files of 250 to 2,000 small attention modules (4 tensors each), and
files of 50,000 tiny tensors holding 1 or 2,000 modules, each folded in process (interleaved rounds),
then the two largest end to end through the CLI. The cost per tensor should stay flat as the count
grows: a run that re-parses a header per read grows quadratically.

    python benchmarks/migration_speed.py                 # 1 GiB, 4 shards, 5 rounds; then many tensors
    python benchmarks/migration_speed.py --size-gib 0.25 --shards 2 --repeats 3
    python benchmarks/migration_speed.py --only many-tensors --repeats 3
    python benchmarks/migration_speed.py --only companions --repeats 5
    python benchmarks/migration_speed.py --only dcp --size-gib 2 --shards 4

Companion files: a model folder of one small safetensors file beside 3,000 or 10,000 tiny files
(100 bytes each), folded in process, against ``cp -r SRC DST && sync`` (the same durability: fold
syncs the companions together, and each shard and folder, before it reports success). Interleaved
rounds; the in-process fold has no start-up cost to subtract.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slim_mha.migration import fold_checkpoint  # noqa: E402

EMBED = 1024
# What a CLI run imports before it migrates anything (torch, safetensors, the migration modules, DCP's
# for a DCP folder): the package imports ._migrate on first use, so importing the CLI module alone would
# leave most of it out.
_IMPORTS = "import slim_mha.migration.cli, slim_mha.migration._migrate, torch.distributed.checkpoint"
# A child that imports everything, resets the kernel's peak-RSS mark (VmHWM, via clear_refs), runs the
# CLI and reports "rss_at_start peak" in bytes: the peak covers the migration alone, not the imports.
_CHILD = f"""
import os, sys
{_IMPORTS}
from slim_mha.migration.cli import main
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
start = status("VmRSS")
if "CAP_EXTRA_BYTES" in os.environ:  # the address space it may use: what it holds now plus this
    import resource
    limit = status("VmSize") + int(os.environ["CAP_EXTRA_BYTES"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
try:
    main(sys.argv[1:])
finally:
    print(start, status("VmHWM"), file=sys.stderr)
"""


def layer_tensors(index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One encoder layer of width EMBED, float32: about 48 MiB."""
    prefix = f"encoder.layers.{index}."
    shapes = {
        "self_attn.in_proj_weight": (3 * EMBED, EMBED),
        "self_attn.in_proj_bias": (3 * EMBED,),
        "self_attn.out_proj.weight": (EMBED, EMBED),
        "self_attn.out_proj.bias": (EMBED,),
        "linear1.weight": (4 * EMBED, EMBED),
        "linear1.bias": (4 * EMBED,),
        "linear2.weight": (EMBED, 4 * EMBED),
        "linear2.bias": (EMBED,),
        "norm1.weight": (EMBED,),
        "norm1.bias": (EMBED,),
    }
    return {prefix + name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def build_checkpoint(directory: Path, size_bytes: int, shards: int) -> list[int]:
    """A sharded stock checkpoint with an HF index; returns the shard sizes in bytes."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    per_layer = sum(t.numel() * t.element_size() for t in layer_tensors(0, generator).values())
    layers = max(shards, round(size_bytes / per_layer))
    weight_map, sizes = {}, []
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for layer in range(shard * layers // shards, (shard + 1) * layers // shards):
            tensors.update(layer_tensors(layer, generator))
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
        sizes.append((directory / name).stat().st_size)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return sizes


def many_tensors_file(path: Path, modules: int, tiny: int) -> int:
    """One safetensors file of ``modules`` stock attention modules of width 8 (4 tensors each) and
    ``tiny`` one-element tensors; returns the number of tensors."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for number in range(modules):
        prefix = f"layers.{number}.attn."
        tensors[prefix + "in_proj_weight"] = torch.randn(24, 8, generator=generator)
        tensors[prefix + "in_proj_bias"] = torch.randn(24, generator=generator)
        tensors[prefix + "out_proj.weight"] = torch.randn(8, 8, generator=generator)
        tensors[prefix + "out_proj.bias"] = torch.randn(8, generator=generator)
    for number in range(tiny):
        tensors[f"extra.{number}.scale"] = torch.randn(1, generator=generator)
    save_file(tensors, path)
    return len(tensors)


def run_many_tensors(work: Path, repeats: int) -> None:
    """Fold time against the number of tensors: flat per tensor when the migration is linear."""
    cases = {  # name -> (modules, tiny tensors)
        "250 modules": (250, 0),
        "500 modules": (500, 0),
        "1,000 modules": (1000, 0),
        "2,000 modules": (2000, 0),
        "50,000 tensors, 1 module": (1, 50_000 - 4),
        "50,000 tensors, 2,000 modules": (2000, 50_000 - 8000),
    }
    files, counts = {}, {}
    for number, (name, (modules, tiny)) in enumerate(cases.items()):
        files[name] = work / f"many{number}.safetensors"
        counts[name] = many_tensors_file(files[name], modules, tiny)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name in cases:
            output = work / "many-out.safetensors"
            times[name].append(
                timed(lambda name=name, output=output: fold_checkpoint(files[name], output, progress=False))
            )
            output.unlink()
    print(f"\nmany tensors: fold (API) in process, median of {repeats} interleaved rounds")
    print(f"{'file':<31} {'tensors':>8} {'MiB':>6} {'median s':>9} {'us/tensor':>10}   per round")
    for name, values in times.items():
        median = statistics.median(values)
        size = files[name].stat().st_size / 2**20
        rounds = " ".join(f"{value:.2f}" for value in values)
        print(f"{name:<31} {counts[name]:>8} {size:6.2f} {median:9.3f} {median / counts[name] * 1e6:10.1f}   {rounds}")

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = {
        "start-up": lambda: subprocess.run([sys.executable, "-c", _IMPORTS], check=True, env=env),
        **{
            f"CLI fold, {name}": lambda name=name: subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "slim_mha.migration",
                    "fold",
                    str(files[name]),
                    str(work / "many-cli.safetensors"),
                    "--quiet",
                    "--force",
                ],
                check=True,
                env=env,
            )
            for name in ("2,000 modules", "50,000 tensors, 2,000 modules")
        },
    }
    cli_times: dict[str, list[float]] = {name: [] for name in cli}
    for _ in range(repeats):
        for name, action in cli.items():
            cli_times[name].append(timed(action))
    print(f"\nend to end (python -m slim_mha.migration fold ... --quiet), median of {repeats} interleaved rounds")
    for name, values in cli_times.items():
        rounds = " ".join(f"{value:.2f}" for value in values)
        print(f"{name:<44} {statistics.median(values):7.3f} s   {rounds}")


def companions_folder(path: Path, count: int) -> None:
    """A model folder: one small stock checkpoint and ``count`` companion files of 100 bytes."""
    path.mkdir()
    generator = torch.Generator().manual_seed(0)
    save_file(
        {
            "attn.in_proj_weight": torch.randn(24, 8, generator=generator),
            "attn.in_proj_bias": torch.randn(24, generator=generator),
            "attn.out_proj.weight": torch.randn(8, 8, generator=generator),
            "attn.out_proj.bias": torch.randn(8, generator=generator),
        },
        path / "model.safetensors",
    )
    for number in range(count):
        (path / f"file{number:05d}.txt").write_bytes(bytes([number % 256]) * 100)


def run_companions(work: Path, repeats: int) -> None:
    """Fold against cp -r + sync for a folder of thousands of small companion files."""
    counts = (3000, 10000)
    for count in counts:
        companions_folder(work / f"companions{count}", count)
    runs = {}
    for count in counts:
        source = work / f"companions{count}"
        runs[f"cp -r + sync, {count:,} files"] = lambda source=source: (
            subprocess.run(["cp", "-r", str(source), str(work / "out")], check=True),
            os.sync(),
        )
        runs[f"fold (API), {count:,} files"] = lambda source=source: fold_checkpoint(
            source, work / "out", progress=False
        )
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, action in runs.items():
            times[name].append(timed(action))
            shutil.rmtree(work / "out")
    print(f"\ncompanion files: median of {repeats} interleaved rounds")
    for name, values in times.items():
        count = name.split(", ")[1]
        baseline = times[f"cp -r + sync, {count}"]
        ratio = statistics.median(value / copy for value, copy in zip(values, baseline))
        rounds = " ".join(f"{value:.2f}" for value in values)
        print(f"{name:<30} {statistics.median(values):7.3f} s  x cp+sync {ratio:5.2f}   {rounds}")


def copy_and_fsync(source: Path, destination: Path) -> None:
    subprocess.run(["cp", "-r", str(source), str(destination)], check=True)
    for path in [*sorted(destination.iterdir()), destination, destination.parent]:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def timed(action) -> float:
    os.sync()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def child_extra_memory(*argv: str, cap: int | None = None) -> int:
    """Peak RSS of a CLI run above the RSS it had after its imports, in bytes; ``cap``: the run may map
    at most this many bytes more than it held after its imports (RLIMIT_AS)."""
    extra = {} if cap is None else {"CAP_EXTRA_BYTES": str(cap)}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT), **extra},
    )
    if result.returncode != 0:
        raise SystemExit(f"child failed: {result.stderr.strip()}")
    start, peak = map(int, result.stderr.strip().splitlines()[-1].split())
    return peak - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to build (default: a temp dir)")
    parser.add_argument(
        "--only",
        choices=["copy", "many-tensors", "companions", "dcp"],
        default=None,
        help="run one part: the 1 GiB comparison with cp, the many-tensors scaling, the companion files, "
        "or a DCP folder's peak memory",
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="slim-mha-migration-bench-", dir=args.dir))
    try:
        if args.only in (None, "copy"):
            run_copy_comparison(work, args)
        if args.only in (None, "many-tensors"):
            run_many_tensors(work, args.repeats)
        if args.only in (None, "companions"):
            run_companions(work, args.repeats)
        if args.only in (None, "dcp"):
            run_dcp_memory(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_dcp_folder(directory: Path, size_bytes: int, files: int) -> list[int]:
    """A DCP folder as dcp.save writes it in one process with ``files`` writer threads (one data file
    each, as ranks give under FSDP); returns the data files' sizes."""
    import warnings

    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(0)
    per_layer = sum(t.numel() * t.element_size() for t in layer_tensors(0, generator).values())
    state = {}
    for layer in range(max(files, round(size_bytes / per_layer))):
        state.update(layer_tensors(layer, generator))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming one process", as intended
        dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(directory, thread_count=files))
    del state
    return [path.stat().st_size for path in sorted(directory.glob("*.distcp"))]


def run_dcp_memory(work: Path, args: argparse.Namespace) -> None:
    """Peak memory of migrating a DCP folder, against its size and its largest data file; then the same
    runs under an address-space cap of a quarter of the folder."""
    source = work / "dcp"
    sizes = build_dcp_folder(source, int(args.size_gib * 2**30), args.shards)
    total = sum(sizes)
    print(
        f"DCP folder: {total / 2**30:.3f} GiB in {len(sizes)} data files (largest {max(sizes) / 2**20:.1f} MiB), "
        f"torch {torch.__version__}, python {sys.version.split()[0]}"
    )
    print("peak RSS during the run, above the RSS after imports")
    runs = (
        ("inspect", ["inspect", str(source)]),
        ("fold (DCP out)", ["fold", str(source), str(work / "d1"), "--quiet"]),
        ("strip --verify (DCP out)", ["strip", str(source), str(work / "d2"), "--quiet", "--verify"]),
        ("to-stock --verify (of strip's)", ["to-stock", str(work / "d2"), str(work / "d3"), "--quiet", "--verify"]),
        ("fold --to safetensors", ["fold", str(source), str(work / "d4"), "--quiet", "--to", "safetensors"]),
    )
    for label, argv in runs:
        extra = child_extra_memory(*argv)
        print(
            f"{label:<31} extra {extra / 2**20:8.1f} MiB = {extra / total:.3f} x folder, "
            f"{extra / max(sizes):.3f} x largest file"
        )
    cap = total // 4
    print(f"under a cap of {cap / 2**20:.0f} MiB of address space above the imports (a quarter of the folder):")
    for label, argv in runs[1:3]:
        shutil.rmtree(argv[2], ignore_errors=True)
        extra = child_extra_memory(*argv, cap=cap)
        print(f"{label:<31} completes, extra {extra / 2**20:8.1f} MiB")


def run_copy_comparison(work: Path, args: argparse.Namespace) -> None:
    """Speed against cp -r, and peak memory against the largest shard, on a 1 GiB sharded checkpoint."""
    source = work / "stock"
    sizes = build_checkpoint(source, int(args.size_gib * 2**30), args.shards)
    total = sum(sizes)
    print(
        f"checkpoint: {total / 2**30:.3f} GiB in {len(sizes)} shards (largest {max(sizes) / 2**20:.1f} MiB), "
        f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    runs = {
        "cp -r": lambda: subprocess.run(["cp", "-r", str(source), str(work / "copy")], check=True),
        # The same durability as fold, which fsyncs each file, the folder and the folder holding it
        # before it reports success: cp alone leaves its writes in the page cache.
        "cp -r + fsync": lambda: copy_and_fsync(source, work / "copy-fsync"),
        "fold (API)": lambda: fold_checkpoint(source, work / "api", progress=False),
        "fold (CLI)": lambda: subprocess.run(
            [sys.executable, "-m", "slim_mha.migration", "fold", str(source), str(work / "cli"), "--quiet"],
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        ),
        # The CLI's fixed cost: start Python and import torch, safetensors and migration.
        "start-up": lambda: subprocess.run(
            [sys.executable, "-c", _IMPORTS], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, action in runs.items():
            times[name].append(timed(action))
        for leftover in ("copy", "copy-fsync", "api", "cli"):
            shutil.rmtree(work / leftover)
    # "x cp" is the median over rounds of (this run / the cp run of the same round): robust to the
    # machine's load drifting between rounds.
    print(f"\n{'command':<14} {'median s':>9} {'min s':>7} {'GiB/s':>6} {'x cp':>6} {'x cp+fsync':>10}   per round")
    for name, values in times.items():
        median = statistics.median(values)
        ratios = [
            statistics.median(value / copy for value, copy in zip(values, times[baseline]))
            for baseline in ("cp -r", "cp -r + fsync")
        ]
        rounds = " ".join(f"{value:.2f}" for value in values)
        print(
            f"{name:<14} {median:9.3f} {min(values):7.3f} {total / 2**30 / median:6.2f} {ratios[0]:6.2f} "
            f"{ratios[1]:10.2f}   {rounds}"
        )

    print(f"\npeak RSS during the run, above the RSS after imports; largest shard {max(sizes) / 2**20:.1f} MiB")
    # A torch pickle is one shard by definition: the largest shard, re-saved as a .pt.
    largest = source / f"model-{sizes.index(max(sizes)) + 1:05d}-of-{len(sizes):05d}.safetensors"
    torch.save({"state_dict": load_file(largest)}, work / "largest.pt")
    for label, argv in (
        ("fold", ["fold", str(source), str(work / "m1"), "--quiet"]),
        ("fold --verify", ["fold", str(source), str(work / "m2"), "--quiet", "--verify"]),
        (
            "fold --fold-value-bias --verify",
            ["fold", str(source), str(work / "m3"), "--quiet", "--verify", "--fold-value-bias"],
        ),
        ("strip --verify", ["strip", str(source), str(work / "m5"), "--quiet", "--verify"]),
        (
            "to-stock --verify (of strip's output)",
            ["to-stock", str(work / "m5"), str(work / "m4"), "--quiet", "--verify"],
        ),
        ("inspect", ["inspect", str(source)]),
        (
            ".pt (= largest shard) fold --verify",
            ["fold", str(work / "largest.pt"), str(work / "pt.safetensors"), "--quiet", "--verify"],
        ),
    ):
        extra = child_extra_memory(*argv)
        print(f"{label:<36} extra {extra / 2**20:7.1f} MiB = {extra / max(sizes):.3f} x largest shard")


if __name__ == "__main__":
    main()
