"""Migrating ``torch.distributed.checkpoint`` folders written by ``dcp.save`` in one process.

Each output is loaded with ``dcp.load`` into a stock model and a slim one (a stripped folder through
``StrippedLoadPlanner``) and compared, tensor for tensor, with the same migration done in memory on
the state dict that was saved. FSDP2's sharded folders: tests/test_distributed.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import slim_mha
from slim_mha.migration import (
    NothingToDo,
    StrippedLoadPlanner,
    fold_checkpoint,
    fold_state_dict,
    inspect_checkpoint,
    strip_checkpoint,
    strip_state_dict,
    to_stock_checkpoint,
)

from _migration_checkpoints import tree_digest
from _migration_helpers import private_ledger, reads_pickles, run_cli  # noqa: F401 (autouse fixture)
from _reference import randomize_parameters

dcp = pytest.importorskip("torch.distributed.checkpoint")
pytestmark = [
    reads_pickles,  # DCP's chunks are torch pickles: refused before torch 2.10, as other pickles are
    pytest.mark.filterwarnings("ignore:.*(single process|process group|assuming the intent).*:UserWarning"),
]


class Model(nn.Module):
    """An encoder layer (batch-first self-attention), cross-attention with kdim/vdim, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.cross = nn.MultiheadAttention(16, 2, kdim=12, vdim=8)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        hidden = self.layer(x).transpose(0, 1)
        return self.head(self.cross(hidden, memory[..., :12], memory[..., :8])[0])


def build(patched: bool = False, seed: int = 0) -> Model:
    torch.manual_seed(seed)
    with slim_mha.patched() if patched else contextlib.nullcontext():
        model = Model()
    attention = [module for module in model.modules() if isinstance(module, nn.MultiheadAttention)]
    for number, module in enumerate(attention, 1):  # a non-zero key bias, which migration must handle
        randomize_parameters(module, seed=100 * seed + number)
    return model


@pytest.fixture
def saved(tmp_path):
    """A DCP folder of the model's state dict beside a step count and a nested dict (non-tensor entries)."""
    model = build()
    folder = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "step": 7, "extra": {"lr": 0.1}}, checkpoint_id=folder)
    return folder, model.state_dict()


def loaded(folder, *, patched: bool, planner=None) -> tuple[dict, int]:
    """``dcp.load`` into a fresh model of other weights; its state dict and the step."""
    model = build(patched, seed=5)
    state = {"model": model.state_dict(), "step": 0, "extra": {"lr": 0.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=folder, **({"planner": planner} if planner else {}))
    model.load_state_dict(state["model"])
    assert state["extra"] == {"lr": 0.1}
    return model.state_dict(), state["step"]


def assert_equal_states(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key


@pytest.mark.parametrize("patched", [False, True], ids=["stock", "slim"])
def test_fold_writes_a_dcp_folder_that_loads_as_the_in_memory_fold(saved, tmp_path, patched):
    source, state = saved
    before = tree_digest(source)
    report = fold_checkpoint(source, tmp_path / "folded", verify=True)
    assert sorted(module.name for module in report.modules if module.changed) == [
        "model.cross",
        "model.layer.self_attn",
    ]
    assert tree_digest(source) == before  # SRC untouched
    actual, step = loaded(tmp_path / "folded", patched=patched)
    assert step == 7
    assert_equal_states(actual, fold_state_dict(state))


@pytest.mark.parametrize("patched", [False, True], ids=["stock", "slim"])
def test_strip_drops_the_key_bias_bytes_and_loads_through_the_planner(saved, tmp_path, patched):
    source, state = saved
    strip_checkpoint(source, tmp_path / "stripped", verify=True)
    with open(tmp_path / "stripped" / ".metadata", "rb") as file:
        described = pickle.load(file).state_dict_metadata
    stripped = {f"model.{key}": value for key, value in strip_state_dict(state).items()}
    assert {key for key in described if key.startswith("model.")} == set(stripped)
    blob = b"".join(path.read_bytes() for path in (tmp_path / "stripped").glob("*.distcp"))
    key_bias = state["layer.self_attn.in_proj_bias"][16:32]
    assert key_bias.abs().min() > 0 and key_bias.numpy().tobytes() not in blob  # b_k is not in the files
    actual, step = loaded(tmp_path / "stripped", patched=patched, planner=StrippedLoadPlanner())
    assert step == 7
    assert_equal_states(actual, fold_state_dict(state))  # [b_q; 0; b_v]: what slim computes with


def test_to_stock_of_a_stripped_folder_loads_without_a_planner(saved, tmp_path):
    source, state = saved
    strip_checkpoint(source, tmp_path / "stripped")
    to_stock_checkpoint(tmp_path / "stripped", tmp_path / "back", verify=True)
    actual, _ = loaded(tmp_path / "back", patched=False)
    assert_equal_states(actual, fold_state_dict(state))
    with pytest.raises(NothingToDo):
        to_stock_checkpoint(tmp_path / "back", tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_to_safetensors_writes_shards_and_an_index_and_names_what_it_left_out(saved, tmp_path):
    from safetensors.torch import load_file

    source, state = saved
    report = strip_checkpoint(source, tmp_path / "st", to="safetensors", verify=True)
    files = sorted(path.name for path in (tmp_path / "st").iterdir())
    assert files == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    written = load_file(tmp_path / "st" / files[0])
    assert_equal_states(written, {f"model.{key}": value for key, value in strip_state_dict(state).items()})
    assert any("left out 2 non-tensor entries" in note and "step" in note for note in report.notes)


def test_the_cli_inspects_and_migrates_and_refuses_dcp_output_for_other_sources(saved, tmp_path, capsys):
    source, _ = saved
    code, out, _ = run_cli(["inspect", source], capsys)
    assert code == 0 and "2 attention modules" in out and "model.cross" in out
    code, out, _ = run_cli(["fold", source, tmp_path / "out", "--verify"], capsys)
    assert code == 0 and "wrote" in out
    code, _, err = run_cli(["fold", source, tmp_path / "out"], capsys)
    assert code == 1 and "already exists; pass --force" in err
    code, _, _ = run_cli(["fold", source, tmp_path / "out", "--force"], capsys)  # our own output: replaced
    assert code == 0
    code, _, err = run_cli(["fold", tmp_path / "out", tmp_path / "x.safetensors", "--to", "dcp"], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1


def test_force_never_replaces_a_dcp_folder_this_tool_did_not_write(saved, tmp_path, capsys):
    source, state = saved
    foreign = tmp_path / "theirs"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": state}, checkpoint_id=foreign)
    before = tree_digest(foreign)
    code, _, err = run_cli(["fold", source, foreign, "--force"], capsys)
    assert code == 1 and "has no slim_mha.json of ours" in err and "Traceback" not in err
    assert tree_digest(foreign) == before


def _copy(source, target):
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda folder: next(folder.glob("*.distcp")).unlink(), "does not exist; copy the whole folder"),
        (lambda folder: next(folder.glob("*.distcp")).write_bytes(b"PK"), "the data file is truncated"),
        (lambda folder: (folder / ".metadata").write_bytes(b"not a pickle"), "does not read as torch.distributed"),
    ],
    ids=["missing shard", "truncated shard", "not DCP"],
)
def test_a_damaged_folder_gets_one_line_and_nothing_is_written(saved, tmp_path, capsys, damage, message):
    source, _ = saved
    broken = _copy(source, tmp_path / "broken")
    damage(broken)
    code, _, err = run_cli(["fold", broken, tmp_path / "out"], capsys)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_metadata_that_refers_to_absent_data_is_refused(saved, tmp_path, capsys):
    source, _ = saved
    broken = _copy(source, tmp_path / "broken")
    with open(broken / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    missing = next(index for index in metadata.storage_data if index.fqn == "model.cross.q_proj_weight")
    del metadata.storage_data[missing]
    (broken / ".metadata").write_bytes(pickle.dumps(metadata))
    code, _, err = run_cli(["inspect", broken], capsys)
    assert code == 1 and "'model.cross.q_proj_weight' has no data in any file of the folder" in err


def test_metadata_that_would_run_code_is_refused_unrun(saved, tmp_path, capsys):
    source, _ = saved
    broken = _copy(source, tmp_path / "broken")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (broken / ".metadata").write_bytes(pickle.dumps(Payload()))
    code, _, err = run_cli(["inspect", broken], capsys)
    assert code == 1 and "which DCP's metadata never holds" in err
    assert not marker.exists()


def test_inspect_reads_no_tensor_data_but_the_biases_it_reports(saved, monkeypatch):
    from slim_mha.migration._dcp import DcpRecord

    source, _ = saved
    read = []
    original = DcpRecord.read_chunk
    monkeypatch.setattr(DcpRecord, "read_chunk", lambda self, storage: read.append(self.key) or original(self, storage))
    report = inspect_checkpoint(source)
    assert report.tensors == len(build().state_dict())
    assert set(read) <= {"model.layer.self_attn.in_proj_bias", "model.cross.in_proj_bias"}


def test_the_documented_dcp_example_runs(tmp_path, monkeypatch):
    """docs/migration.md's DCP block, which its own test skips on a torch that refuses DCP's pickles."""
    from test_docs_examples import read_blocks

    (block,) = [b for b in read_blocks("docs/migration.md") if "StrippedLoadPlanner()" in b.code]
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(block.code, str(block), "exec"), {"__name__": "__main__"})


def test_a_dry_run_writes_nothing_and_companion_files_are_copied(saved, tmp_path):
    source, _ = saved
    (source / "README.md").write_text("trained for 7 steps\n")
    (source / "notes").mkdir()
    report = fold_checkpoint(source, tmp_path / "dry", dry_run=True, verify=True)
    assert not (tmp_path / "dry").exists() and report.output_bytes > 0
    report = fold_checkpoint(source, tmp_path / "out")
    assert (tmp_path / "out" / "README.md").read_text() == "trained for 7 steps\n"
    assert report.companions == ("README.md",) and any("notes/" in note for note in report.notes)
    recorded = json.loads((tmp_path / "out" / "slim_mha.json").read_text())
    assert recorded["slim_mha.mode"] == "fold" and "README.md" in recorded["slim_mha.companions"]
    fold_checkpoint(source, tmp_path / "out", force=True)  # its own companion: replaced with the rest


def test_verify_fails_on_a_wrong_copy_and_nothing_is_written(saved, tmp_path, monkeypatch):
    """The read-back must be able to fail: the first copied byte range taken one byte late."""
    from slim_mha.migration import _dcp_writer

    source, _ = saved
    copy = _dcp_writer.copy_range
    monkeypatch.setattr(
        _dcp_writer, "copy_range", lambda src, offset, *rest, **named: copy(src, offset + (offset == 0), *rest, **named)
    )
    with pytest.raises(RuntimeError, match="differs from SRC's bytes; nothing was written"):
        fold_checkpoint(source, tmp_path / "out", verify=True)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_run_killed_while_writing_leaves_no_dst_and_the_next_run_cleans_up(saved, tmp_path):
    source, _ = saved
    ready, out = tmp_path / "ready", tmp_path / "out"
    tests = str(Path(__file__).parent)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [
            sys.executable,
            str(Path(tests) / "_paused_migration.py"),
            "after-first-shard",
            str(ready),
            "fold",
            str(source),
            str(out),
        ],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    process.kill()
    process.wait(timeout=60)
    assert not out.exists()
    report = fold_checkpoint(source, out, verify=True)
    assert out.is_dir() and [name for name in os.listdir(tmp_path) if name.startswith(".out")] == []
    assert any("removed" in note for note in report.notes)


def test_training_resumes_from_a_stripped_folder_with_optimizer_state(tmp_path):
    """FSDP2's usual save: the model and Adam's state (``get_state_dict``). Strip renames the model's
    biases; Adam's moments stay under the parameter's own name, which slim keeps: a resumed step is the
    step the uninterrupted run takes, bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def trained(seed: int):
        model = build(patched=True, seed=seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, optimizer

    def step(model, optimizer, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        x, memory = torch.randn(2, 5, 16, generator=generator), torch.randn(4, 2, 16, generator=generator)
        optimizer.zero_grad()
        model(x, memory).pow(2).mean().backward()
        optimizer.step()

    model, optimizer = trained(0)
    for seed in range(2):
        step(model, optimizer, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=tmp_path / "ckpt")
        strip_checkpoint(tmp_path / "ckpt", tmp_path / "stripped", verify=True)
        resumed, resumed_optimizer = trained(5)
        model_state, optimizer_state = get_state_dict(resumed, resumed_optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        dcp.load(state, checkpoint_id=tmp_path / "stripped", planner=StrippedLoadPlanner())
        set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for pair in ((model, optimizer), (resumed, resumed_optimizer)):
        step(*pair, seed=7)
    expected, actual = model.state_dict(), resumed.state_dict()
    for key, tensor in expected.items():
        if key.endswith("in_proj_bias"):  # the key slot: b_k in the uninterrupted run, zero once stripped
            keep = torch.ones_like(tensor, dtype=torch.bool)
            keep[tensor.shape[0] // 3 : 2 * tensor.shape[0] // 3] = False
            tensor, other = tensor[keep], actual[key][keep]
        else:
            other = actual[key]
        assert torch.equal(other, tensor), key


def test_metadata_of_dcp_classes_put_together_wrongly_gets_one_line(saved, tmp_path, capsys):
    """Only DCP's classes unpickle, but a crafted file can still put one where another belongs."""
    source, _ = saved
    broken = _copy(source, tmp_path / "broken")
    with open(broken / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    metadata.storage_data = {"model.cross.q_proj_weight": next(iter(metadata.state_dict_metadata.values()))}
    (broken / ".metadata").write_bytes(pickle.dumps(metadata))
    code, _, err = run_cli(["inspect", broken], capsys)
    assert code == 1 and "is not put together as DCP writes its metadata" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "intrusion",
    [
        lambda out: (out / "__9_0.distcp").write_bytes(b"someone's shard"),
        lambda out: (out / "README.md").write_text("edited after the run\n"),
        lambda out: (out / "notes.txt").write_text("added after the run\n"),
    ],
    ids=["an added data file", "an edited companion", "an added file"],
)
def test_force_replaces_its_own_output_only_as_it_wrote_it(saved, tmp_path, capsys, intrusion):
    """--force names, and never deletes, what no earlier run wrote into DST, or what changed since."""
    source, _ = saved
    (source / "README.md").write_text("trained for 7 steps\n")
    out = tmp_path / "out"
    fold_checkpoint(source, out)
    intrusion(out)
    before = tree_digest(out)
    code, _, err = run_cli(["fold", source, out, "--force"], capsys)
    assert code == 1 and "would delete it with DST, and no earlier run wrote it" in err, err
    assert tree_digest(out) == before
