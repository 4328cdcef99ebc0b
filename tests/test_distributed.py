"""A patched model trained by 2 CPU processes (gloo, loopback) under DDP and FSDP2.

The workers (tests/_distributed_worker.py) check that the ranks agree and match a single-process
run; here the state dict rank 0 saved from the wrapper is loaded back into a slim model and, via
``to_stock``, into a stock one.
"""

from __future__ import annotations

import time
from pathlib import Path

import _distributed_worker as worker
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from slim_mha import to_stock
from slim_mha.migration import fold_state_dict

from _reference import STOCK_MHA, assert_close_scaled

WORLD_SIZE = 2
TIMEOUT_S = 120

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs the gloo backend"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Spawn the workers once (DDP, then FSDP2) and wait at most TIMEOUT_S; a worker's exception fails."""
    out_dir = tmp_path_factory.mktemp("distributed")
    context = mp.start_processes(
        worker.run,
        args=(WORLD_SIZE, str(out_dir)),
        nprocs=WORLD_SIZE,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):  # raises ProcessRaisedException if a worker failed
        if time.monotonic() > deadline:
            for process in context.processes:  # only the processes this fixture started
                if process.is_alive():
                    process.kill()
            pytest.fail(f"distributed workers did not finish within {TIMEOUT_S}s")
    return out_dir


def load_back(saved_file: Path, *, strip_prefix: str = "") -> None:
    """The saved wrapper state dict loads strictly into a fresh patched model and, converted, into stock."""
    saved = torch.load(saved_file)
    state, expected = saved["state_dict"], saved["probe_output"]
    consume_prefix_in_state_dict_if_present(state, strip_prefix)
    x = worker.probe()

    slim = worker.build_model()
    slim.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert_close_scaled(slim(x), expected, "slim output")

    torch.manual_seed(0)
    stock = worker.Model()  # built unpatched: torch's own attention
    assert all(type(m) is STOCK_MHA for m in stock.modules() if isinstance(m, STOCK_MHA))
    stock.load_state_dict(slim.state_dict(), strict=True)  # stock's layout: no conversion needed
    with torch.no_grad():
        assert_close_scaled(stock(x), expected, "stock output, slim's state dict")
    stock.load_state_dict(to_stock(slim).state_dict(), strict=True)
    with torch.no_grad():
        assert_close_scaled(stock(x), expected, "stock output")


def test_ddp_trains_a_patched_model_in_sync(trained):
    """In the workers: find_unused_parameters=False, ranks equal, equal to one process on all data."""
    load_back(trained / "ddp.pt", strip_prefix="module.")


def test_fsdp2_trains_a_patched_model_in_sync(trained):
    """The same under fully_shard on a CPU device mesh; the full state dict is gathered to save."""
    unsupported = trained / "fsdp2-unsupported.txt"
    if unsupported.exists():
        pytest.skip(unsupported.read_text())
    load_back(trained / "fsdp2.pt")


@pytest.mark.parametrize("kind", worker.DCP_MODELS)
@pytest.mark.parametrize("mode", worker.DCP_MODES)
def test_fsdp2_dcp_folders_migrate_and_load_back_exact(trained, mode, kind):
    """FSDP2's sharded DCP folder, migrated in one process, loads into a sharded stock model and a slim
    one as the in-memory migration of the gathered state dict: strip through StrippedLoadPlanner (its
    add_bias_kv module kept, as strip cannot drop that key bias), fold and to-stock as they are."""
    loaded_file = trained / f"fsdp2-dcp-{mode}-{kind}.pt"
    if (trained / "fsdp2-unsupported.txt").exists() or not loaded_file.exists():
        pytest.skip("no FSDP2 here, or DCP's pickled chunks are refused by this torch (tests/test_migration_dcp.py)")
    saved = torch.load(trained / "fsdp2.pt")
    original, probe_output = saved["state_dict"], saved["probe_output"]
    expected = fold_state_dict(original, zero_attn=["attention"])
    if mode != "fold":  # strip kept the add_bias_kv module as it was, and to-stock read strip's output
        expected.update({name: tensor for name, tensor in original.items() if name.startswith("attention.")})
    loaded = torch.load(loaded_file)
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    slim = worker.build_model()
    slim.load_state_dict(loaded, strict=True)
    with torch.no_grad():
        assert_close_scaled(slim(worker.probe()), probe_output, f"slim output after {mode}")


def test_ddp_broadcast_reaches_a_key_bias_written_per_rank(trained):
    """In the workers: ranks initialised differently agree after DDP's broadcast, slim as stock."""
    assert (trained / "ddp-broadcast.ok").exists()


def test_fsdp2_deferred_init_and_gradients_through_in_proj_bias_as_stock(trained):
    """In the workers: meta, fully_shard, to_empty, init through in_proj_bias, clip and freeze it."""
    unsupported = trained / "fsdp2-unsupported.txt"
    if unsupported.exists():
        pytest.skip(unsupported.read_text())
    assert (trained / "fsdp2-idioms.ok").exists()
