"""Worker processes for tests/test_distributed.py (a module of its own so that spawn can import it).

Each worker trains a model built under ``slim_mha.patched()`` for a few steps on its own slice of
the data, then checks that every rank holds the same parameters, and that they equal a
single-process run on all the data (DDP and FSDP average the per-rank gradients, so the reference
minimises the mean of the per-rank losses). Rank 0 saves the state dict the wrapper gives, and the
reference output on a probe batch, for the parent test to load back.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from slim_mha import SlimMultiheadAttention, patched

E, H, FF = 16, 4, 32
BATCH, LENGTH, STEPS, LEARNING_RATE = 2, 6, 3, 0.05
TIMEOUT = timedelta(seconds=60)


class Model(nn.Module):
    """torch's encoder, then an attention module that keeps every slim parameter kind in use."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        # add_zero_attn keeps k_proj_bias, add_bias_kv adds bias_k/bias_v: all must get gradients,
        # or DDP with find_unused_parameters=False fails on the next step.
        self.attention = nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(x)
        return self.attention(hidden, hidden, hidden, need_weights=False)[0]  # (B, L, E)


def build_model() -> Model:
    torch.manual_seed(0)
    with patched():
        model = Model()
    attention = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    assert len(attention) == 3 and all(isinstance(m, SlimMultiheadAttention) for m in attention)
    with torch.no_grad():  # non-zero biases everywhere, identical on every rank
        generator = torch.Generator().manual_seed(0)
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(BATCH, LENGTH, E, generator=torch.Generator().manual_seed(1000 * step + rank))


def probe() -> torch.Tensor:
    return torch.randn(3, LENGTH, E, generator=torch.Generator().manual_seed(99))


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def train(model: nn.Module, batches) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for x in batches:
        optimizer.zero_grad()
        loss_of(model(x)).backward()
        optimizer.step()


def train_reference(world_size: int) -> Model:
    """One process, all ranks' data: the loss is the mean of the per-rank losses."""
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = sum(loss_of(model(batch(rank, step))) for rank in range(world_size)) / world_size
        loss.backward()
        optimizer.step()
    return model


def join_group(rank: int, world_size: int, out_dir: Path) -> None:
    """Rendezvous through a file in the run's own folder: a port chosen by the parent could be taken by
    another process before rank 0 listens on it."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir / 'rendezvous'}", rank=rank, world_size=world_size, timeout=TIMEOUT
    )


def assert_ranks_agree(state: dict[str, torch.Tensor], world_size: int) -> None:
    flat = torch.cat([tensor.detach().flatten().float() for _, tensor in sorted(state.items())])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    for rank, other in enumerate(gathered):
        assert torch.equal(other, gathered[0]), f"rank {rank}'s parameters differ from rank 0's"


def assert_matches_reference(state: dict[str, torch.Tensor], reference_model: Model) -> None:
    reference = reference_model.state_dict()
    initial = build_model().state_dict()
    assert list(state) == list(reference), f"keys differ: {set(state) ^ set(reference)}"
    for name, expected in reference.items():
        actual = state[name].detach()
        error = (actual - expected).abs().max().item()
        assert error <= 1e-5 * max(1.0, expected.abs().max().item()), f"{name}: off the reference by {error:.3e}"
    moved = [name for name in reference if not torch.equal(reference[name], initial[name])]
    assert len(moved) == len(reference), f"parameters never trained: {set(reference) - set(moved)}"


def check_and_save(path: Path, state: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], world_size: int) -> None:
    """On rank 0 only: compare with the single-process run, save what the wrapper's state dict gave."""
    reference = train_reference(world_size)
    assert_matches_reference(state, reference)
    with torch.no_grad():
        output = reference(probe())
    saved = {name: tensor.detach().clone() for name, tensor in saved.items()}
    torch.save({"state_dict": saved, "probe_output": output}, path)


def train_ddp(rank: int, world_size: int, out_dir: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = build_model()
    wrapped = DistributedDataParallel(model, find_unused_parameters=False)
    train(wrapped, [batch(rank, step) for step in range(STEPS)])
    assert_ranks_agree(model.state_dict(), world_size)
    if rank == 0:  # the wrapper's own state dict, with its "module." prefix
        check_and_save(out_dir / "ddp.pt", model.state_dict(), wrapped.state_dict(), world_size)
    dist.barrier()


def import_fully_shard():
    """FSDP2's ``fully_shard``, or the reason this torch has none."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch before 2.6 has FSDP2 under its first, private name
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError as error:
            return f"torch {torch.__version__} has no FSDP2 ({error!r})"
    return fully_shard


def train_fsdp2(rank: int, world_size: int, out_dir: Path) -> bool:
    """Whether this torch's FSDP2 trained here (every rank finds out alike, before any collective)."""
    unsupported = out_dir / "fsdp2-unsupported.txt"  # the parent test skips with the reason written there
    fully_shard = import_fully_shard()
    if isinstance(fully_shard, str):
        if rank == 0:
            unsupported.write_text(fully_shard)
        return False
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    model = build_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        train(model, [batch(rank, step) for step in range(STEPS)])
    except RuntimeError as error:
        # torch 2.4's FSDP2 creates CUDA streams at its first forward whatever the mesh's device, on
        # every rank alike and before any collective: it cannot train on a machine without CUDA.
        if torch.cuda.is_available() or "CUDA" not in str(error):
            raise
        if rank == 0:
            reason = str(error).splitlines()[0]
            unsupported.write_text(f"torch {torch.__version__}'s FSDP2 needs CUDA even on a CPU mesh ({reason})")
        return False
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert_ranks_agree(full, world_size)
    if rank == 0:
        check_and_save(out_dir / "fsdp2.pt", full, full, world_size)
    dist.barrier()
    migrate_dcp_and_load_back(rank, model, out_dir, lambda fresh: shard_model(fresh, fully_shard, mesh))
    return True


def shard_model(model: Model, fully_shard, mesh) -> Model:
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


DCP_MODES = ("strip", "fold", "to-stock")  # to-stock: of strip's output
DCP_MODELS = ("stock", "slim")
ZERO_ATTN = ("model.attention",)  # the add_zero_attn module, which a stock layout cannot record


def migrate_dcp_and_load_back(rank: int, model: Model, out_dir: Path, shard) -> None:
    """The sharded state dict saved with DCP (each rank its shards); rank 0 migrates the folder in each
    mode, in one process; every rank loads each output into a fresh sharded stock model and a slim one
    (a stripped folder through StrippedLoadPlanner), whose gathered state dicts rank 0 saves for the
    parent test."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from slim_mha.migration import StrippedLoadPlanner, fold_checkpoint, strip_checkpoint, to_stock_checkpoint
    from slim_mha.migration._torch_pickles import torch_reads_pickles_safely

    if not torch_reads_pickles_safely():  # the migration refuses DCP's pickled chunks there (its own test)
        return
    source = out_dir / "fsdp2-dcp"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=source)
    dist.barrier()
    if rank == 0:
        strip_checkpoint(source, out_dir / "fsdp2-dcp-strip", zero_attn=ZERO_ATTN, keep_inexact=True, verify=True)
        fold_checkpoint(source, out_dir / "fsdp2-dcp-fold", zero_attn=ZERO_ATTN, verify=True)
        to_stock_checkpoint(
            out_dir / "fsdp2-dcp-strip", out_dir / "fsdp2-dcp-to-stock", zero_attn=ZERO_ATTN, verify=True
        )
    dist.barrier()
    for mode in DCP_MODES:
        for kind in DCP_MODELS:
            torch.manual_seed(0)
            fresh = shard(build_model() if kind == "slim" else Model())
            with torch.no_grad():
                for parameter in fresh.parameters():
                    parameter.fill_(7.0)  # nothing of it may survive the load, the key slot included
            state = {"model": get_model_state_dict(fresh)}
            options = {"planner": StrippedLoadPlanner()} if mode == "strip" else {}
            dcp.load(state, checkpoint_id=out_dir / f"fsdp2-dcp-{mode}", **options)
            full = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True))
            if rank == 0:
                loaded = {name: tensor.detach().clone() for name, tensor in full.items()}
                torch.save(loaded, out_dir / f"fsdp2-dcp-{mode}-{kind}.pt")
    dist.barrier()


def attention_pair(build) -> list[nn.Module]:
    """``build()`` unpatched (torch's own attention) and patched (slim), from the same seed."""
    built = []
    for patch in (False, True):
        torch.manual_seed(0)
        if patch:
            with patched():
                built.append(build())
        else:
            built.append(build())
    assert not any(isinstance(m, SlimMultiheadAttention) for m in built[0].modules())
    assert any(isinstance(m, SlimMultiheadAttention) for m in built[1].modules())
    return built


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    error = (actual - expected).abs().max().item()
    assert error <= 1e-5 * max(1.0, expected.abs().max().item()), f"{what}: slim off stock by {error:.3e}"


def ddp_broadcasts_a_key_bias_written_per_rank(rank: int, world_size: int, out_dir: Path) -> None:
    """Ranks that initialise differently, the key bias written through in_proj_bias: DDP's broadcast
    makes every rank rank 0's model, on slim as on stock."""
    from torch.nn.parallel import DistributedDataParallel

    outputs = []
    for module in attention_pair(lambda: nn.MultiheadAttention(E, H, add_bias_kv=True, batch_first=True)):
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(rank)))
        DistributedDataParallel(module)
        assert_ranks_agree(module.state_dict(), world_size)
        x = probe()
        with torch.no_grad():
            outputs.append(module(x, x, x)[0])
    assert_close(outputs[1], outputs[0], "DDP-broadcast add_bias_kv attention")
    if rank == 0:
        (out_dir / "ddp-broadcast.ok").write_text("ok")


def _on_meta(build):
    with torch.device("meta"):
        return build()


def fsdp2_deferred_init_and_gradients_as_stock(rank: int, world_size: int, out_dir: Path) -> None:
    """torchtitan's pattern: meta, fully_shard, to_empty, init through in_proj_bias; then gradients
    read and clipped through in_proj_bias, and a frozen in_proj_bias. Slim against stock."""
    fully_shard = import_fully_shard()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    results = []
    for model in attention_pair(lambda: _on_meta(Model)):
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for index, (name, parameter) in enumerate(model.named_parameters()):
                if name.endswith("in_proj_bias"):
                    nn.init.constant_(parameter, 0.0)
                else:
                    nn.init.constant_(parameter, 0.01 * (index % 7) - 0.02)
        model.attention.in_proj_bias.requires_grad_(False)  # frozen, as a user may freeze it
        loss = loss_of(model(batch(rank, 0)))
        loss.backward()
        biases = [m.in_proj_bias for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
        assert all(b.grad is not None for b in biases[:-1]) and biases[-1].grad is None
        norm = torch.nn.utils.clip_grad_norm_(biases[:-1], 1.0)
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE).step()
        with torch.no_grad():
            results.append(
                (loss.detach(), norm.full_tensor() if hasattr(norm, "full_tensor") else norm, model(probe()))
            )
    (stock_loss, stock_norm, stock_out), (slim_loss, slim_norm, slim_out) = results
    assert torch.isfinite(slim_out).all(), "slim's output is not finite after deferred initialisation"
    assert_close(slim_loss, stock_loss, "FSDP2 loss")
    assert_close(slim_norm, stock_norm, "FSDP2 clipped norm over in_proj_bias")
    assert_close(slim_out, stock_out, "FSDP2 output after a step")
    if rank == 0:
        (out_dir / "fsdp2-idioms.ok").write_text("ok")


def run(rank: int, world_size: int, out_dir: str) -> None:
    """Every check in one process group: spawning and importing torch dominate the test's time."""
    join_group(rank, world_size, Path(out_dir))
    try:
        train_ddp(rank, world_size, Path(out_dir))
        ddp_broadcasts_a_key_bias_written_per_rank(rank, world_size, Path(out_dir))
        if train_fsdp2(rank, world_size, Path(out_dir)):
            fsdp2_deferred_init_and_gradients_as_stock(rank, world_size, Path(out_dir))
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()
