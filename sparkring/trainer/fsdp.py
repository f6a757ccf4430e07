"""The sharded placement's mechanics (FSDP2) for fit(): the model built on every rank under the meta device,
sharded by the wrap policy over the ring's DeviceMesh, each rank materializing only its own
shards, checkpoints through torch.distributed.checkpoint (DCP, which reshards on load, so a
run resumes at another numProc), and the full state gathered to rank 0 at the end.

Initial weights: FSDP2 leaves a meta-built model's values to the caller; trainer.initialize gives
them module by module, and trainer.pretrained reads what lies on storage into each rank's shards."""
from __future__ import annotations

import io
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import sparkring.collective as sr

from . import checkpoints, pretrained, saving
from .activation import blocks, checkpoint_activations, named_blocks
from .checkpoints import FILE, SHARDED, TRAINER_STATE, CheckpointName
from .config import Sharding, is_factory
from .initialize import initialize_modules
from .pretrained import StoredModel

log = logging.getLogger(__name__)


def wrap_units(model: torch.nn.Module, wrap: Tuple[str, ...]) -> List[torch.nn.Module]:
    """The modules sharded as units, innermost first: the model's blocks (activation.blocks: those
    whose class is named in ``wrap``, by default every layer that holds parameters), so a stack of
    layers gathers one layer at a time.

    >>> [type(m).__name__ for m in wrap_units(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), ())]
    ['Linear']
    """
    return list(reversed(blocks(model, wrap)))


def mixed_dtype_units(model: torch.nn.Module, wrap: Tuple[str, ...]) -> Dict[str, Dict[str, List[str]]]:
    """The units (as ``shard`` makes them; "" the model itself) whose trainable parameters hold more
    than one dtype, each with its parameters by dtype: FSDP2 refuses such a unit at its first forward.

    >>> block = torch.nn.ModuleDict({"kept": torch.nn.Linear(2, 2), "cast": torch.nn.Linear(2, 2).bfloat16()})
    >>> mixed_dtype_units(torch.nn.Sequential(block), ())["0"]["torch.bfloat16"]
    ['0.cast.weight', '0.cast.bias']
    """
    # a parameter belongs to the innermost unit around it, as fully_shard applied innermost first decides
    units = sorted((name for name, _ in named_blocks(model, wrap)), key=len, reverse=True)
    by_unit: Dict[str, Dict[str, List[str]]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            unit = next((u for u in units if name.startswith(u + ".")), "")
            by_unit.setdefault(unit, {}).setdefault(str(param.dtype), []).append(name)
    return {unit: dtypes for unit, dtypes in by_unit.items() if len(dtypes) > 1}


def device_mesh(strategy: str):
    """The ring's mesh for ``strategy``: one dimension (fsdp), or (replicate, shard) across and within hosts (hsdp)."""
    return sr.device_mesh(hybrid=strategy == "hsdp")


def build_sharded(model: Any, sharding: Sharding, device: torch.device, seed: int, mesh: Any = None,
                  split: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
                  stored: Optional[StoredModel] = None) -> torch.nn.Module:
    """The rank's model sharded over ``mesh`` (default: the strategy's), with only its own shards
    materialized (a factory's built under the meta device and initialized module by module, then
    what lies on storage read into them: ``stored``; a module's values are every rank's). ``split``
    (tensor parallelism) runs first, then activation checkpointing, then FSDP2, as torchtitan orders them."""
    mesh = device_mesh(sharding.strategy) if mesh is None else mesh
    if stored is not None and stored.empty or stored is None and is_factory(model):
        if stored is not None:
            module, filled = stored.module, pretrained.covered_names(stored)
        else:
            with torch.device("meta"):
                module, filled = model(), set()
        module = shard(split(module) if split is not None else module, sharding, mesh, split is None)
        # offloaded shards live in host memory: FSDP2 copies each to the device when it gathers it
        filled |= pretrained.to_empty(module, torch.device("cpu") if sharding.cpu_offload else device, tie=False)
        initialize_modules(module, seed, pretrained.initializer(module, sharding.init_fn), skip=filled)
        if stored is not None:
            pretrained.fill(stored, module)
        return module
    # every rank holds the driver's values: rank 0's are the initial weights
    module = (stored.module if stored is not None else model).to(device)
    module = shard(split(module) if split is not None else module, sharding, mesh, split is None)
    if stored is not None:
        pretrained.fill(stored, module)
    return module


def shard(module: torch.nn.Module, sharding: Sharding, mesh: Any, whole_ring: bool) -> torch.nn.Module:
    """``module``'s blocks checkpointed as asked, then sharded by FSDP2 over ``mesh`` (each block a unit)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    checkpoint_activations(module, sharding.activation_checkpointing, sharding.wrap)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if sharding.bf16_compute else MixedPrecisionPolicy())
    # pinned host memory makes the copies to and from a GPU asynchronous; a CPU rank has none to pin
    offload = (CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if sharding.cpu_offload
               else OffloadPolicy())
    for unit in wrap_units(module, sharding.wrap):
        fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=offload)
    if whole_ring:  # the shared-memory ring is every rank's: a tensor-parallel model shards over dp only
        from sparkring.collective.fsdp import use_shared_memory

        use_shared_memory(module)  # ranks of one host exchange shards through shared memory, not loopback TCP
    return module


def full_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The whole model's state on rank 0's CPU (every rank calls it; the others get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def write_state(model: torch.nn.Module, store, directory: str) -> None:
    """Every rank writes its files of a sharded model's weights into ``directory`` of ``store``:
    each whole tensor is put together once, on the rank whose file holds it, so no rank holds more
    than its files' tensors (rank 0 does not gather the model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    state = {name: value for name, value in get_model_state_dict(model, options=StateDictOptions()).items()
             if isinstance(value, torch.Tensor)}
    if sr.rank() == 0:
        saving.clear(store, directory)
    # rank 0 decides which names are one tensor (tied), so every rank puts the same tensors together
    sizes = sr.broadcast_object(_distinct_sizes(state) if sr.rank() == 0 else None, root_rank=0)

    def whole(name: str) -> torch.Tensor:
        value = state[name]
        return value.full_tensor() if isinstance(value, DTensor) else value

    written = saving.write_from_every_rank(store, directory, sizes, whole, sr.rank(), sr.size())
    log.info("rank %d wrote %s of the fitted weights into %s", sr.rank(), written or "none", directory)


def _distinct_sizes(state: Dict[str, Any]) -> List[Tuple[str, int]]:
    """Each tensor's name and whole size in bytes, a tied tensor under its first name only."""
    from torch.distributed.tensor import DTensor

    seen, out = set(), []
    for name, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        key = (local.data_ptr(), tuple(value.shape), value.dtype)
        if local.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, value.numel() * value.element_size()))
    return out


# -- checkpoints ------------------------------------------------------------------------------

def _storage(store, path: str, writing: bool):
    import torch.distributed.checkpoint as dcp

    local = store.local_path(path)
    if local is not None:
        return dcp.FileSystemWriter(local) if writing else dcp.FileSystemReader(local)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    url = store.url.rstrip("/") + "/" + path[len(store.root):].lstrip("/") if path.startswith(store.root) else path
    options = dict(store.storage_options)  # an object store's endpoint and credentials
    return FsspecWriter(url, **options) if writing else FsspecReader(url, **options)


class Checkpointer:
    """Writes the sharded checkpoints of one fit: every rank its shards of model and optimizer,
    then rank 0 the trainer's state, which marks the checkpoint complete; the two newest are
    kept. With ``asynchronous``, DCP stages the shards and writes them on a thread of its own over
    a process group of its own while training goes on; the checkpoint is completed at the next
    save or at the end of the fit."""

    def __init__(self, store, run_id: str, asynchronous: bool = False):
        self.store, self.run_id = store, run_id
        self.group = None
        if asynchronous:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # its collectives never meet training's
        self.pending: Optional[Tuple[Any, str, Dict[str, Any]]] = None

    def save(self, epoch: int, model, opt, trainer_state: Dict[str, Any], step: Optional[int] = None) -> None:
        """Every rank's shards after ``epoch``, or inside it before ``step`` (the step to go on at)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        self.finish()
        name = CheckpointName(epoch, step, SHARDED).name
        path = self.store.checkpoint_path(self.run_id, name)
        if sr.rank() == 0:
            self.store.makedirs(path)
        sr.barrier()
        state = {"model": get_model_state_dict(model, options=checkpoints.frozen_free()),
                 "optim": get_optimizer_state_dict(model, opt)}
        writer = _storage(self.store, path, writing=True)
        if self.group is None:
            dcp.save(state, storage_writer=writer)
            self._complete(path, trainer_state)
        else:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            self.pending = (future, path, trainer_state)

    def finish(self) -> None:
        """Complete the checkpoint still being written, if any (every rank calls it)."""
        if self.pending is not None:
            future, path, trainer_state = self.pending
            self.pending = None
            future.result()
            self._complete(path, trainer_state)

    def _complete(self, path: str, trainer_state: Dict[str, Any]) -> None:
        sr.barrier()  # every rank's shards are written
        if sr.rank() == 0:
            buf = io.BytesIO()
            torch.save(trainer_state, buf)
            self.store.write_bytes(f"{path}/{TRAINER_STATE}", buf.getvalue())
            checkpoints.prune(self.store, self.run_id, SHARDED)


def load_latest(store, run_id: str, model, opt) -> Optional[Dict[str, Any]]:
    """Load the run's newest complete checkpoint into ``model`` and ``opt`` at this ring's layout
    (a DCP directory is resharded; a replicated file, written by a ddp fit, is split); the
    trainer's state it holds, or None where there is none. Every rank calls it."""
    newest = checkpoints.latest(store, run_id) if sr.rank() == 0 else None
    if newest is not None and newest.kind == FILE:
        data = store.read_bytes(store.checkpoint_path(run_id, newest.name))
        chosen: Any = ("file", data)
    elif newest is not None:
        chosen = (newest.name, store.read_bytes(store.checkpoint_path(run_id, newest.name, TRAINER_STATE)))
    else:
        chosen = None
    for skipped in _incomplete_after(store, run_id, newest) if sr.rank() == 0 else []:
        log.warning("sharded checkpoint %s of run %s is incomplete; trying the one before", skipped, run_id)
    chosen = sr.broadcast_object(chosen, root_rank=0)
    if chosen is None:
        return None
    if chosen[0] == "file":
        return _load_replicated_file(chosen[1], model, opt)
    return _load_dcp(store, run_id, chosen[0], chosen[1], model, opt)


def _incomplete_after(store, run_id: str, newest: Optional[CheckpointName]) -> List[str]:
    at = newest.position if newest is not None else (-1, -1.0)
    return [c.name for c in checkpoints.listing(store, run_id, SHARDED) if c.position > at]


def _load_dcp(store, run_id: str, name: str, trainer_bytes: bytes, model, opt) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state: Dict[str, Any] = {"model": get_model_state_dict(model, options=checkpoints.frozen_free()),
                             "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, storage_reader=_storage(store, store.checkpoint_path(run_id, name), writing=False))
    set_model_state_dict(model, state["model"], options=checkpoints.frozen_free())
    set_optimizer_state_dict(model, opt, state["optim"])
    return torch.load(io.BytesIO(trainer_bytes), map_location="cpu", weights_only=True)


def _load_replicated_file(data: bytes, model, opt) -> Dict[str, Any]:
    """A ddp fit's checkpoint (whole weights, a plain optimizer's state keyed by parameter
    position) split into this rank's slices: the positions become the parameters' names, which
    torch's full-state-dict loading understands."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    full = StateDictOptions(full_state_dict=True)
    # a file keeps only the parameters that train (checkpoints.trainable_state): the frozen are as built
    set_model_state_dict(model, saved.pop("model"), options=StateDictOptions(full_state_dict=True, strict=False))
    plain = saved.pop("optimizer")
    names = [name for name, _ in model.named_parameters()]
    by_position = {i: names[i] for group in plain["param_groups"] for i in group["params"]}
    keyed: Dict[str, Any] = {"state": {by_position[i]: value for i, value in plain["state"].items()},
             "param_groups": [{**group, "params": [by_position[i] for i in group["params"]]}
                              for group in plain["param_groups"]]}
    set_optimizer_state_dict(model, opt, keyed, options=full)
    return saved
