"""Tensor parallelism of one replica: its process group, its sharded model, its step message.

A replica of ``tensor_parallel_size`` N is N processes (ranks) in one ``torch.distributed`` process
group (NCCL on CUDA, gloo on CPU). Rank 0 runs the whole engine; ranks 1..N-1 run only forwards
(:mod:`replica.worker.tp_worker`). The model is sharded by transformers itself
(``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``, the model's
``base_model_tp_plan``: attention and MLP projections column-wise then row-wise, the output
embedding column-wise with its logits gathered), so each rank holds ``1/N`` of every projection and
``num_kv_heads / N`` KV heads in its paged cache, and every row-wise layer all-reduces its output
(Megatron-LM's layout: Shoeybi et al. 2019, "Megatron-LM", section 3).

What Carpool adds around the library's plan:

* :func:`replica.config.model_files.check_tp_size`: a model whose query or KV heads do not split
  over N is refused (KV heads are not replicated).
* :func:`localize`: the parameters the plan made ``DTensor``\\ s become their local shards, and the
  library's per-layer forwards are taken off, so that Carpool's prepacked linear kernels can pack
  the local shards (:func:`~replica.worker.compilation.prepack_linears`); :func:`install_forwards`
  then puts the library's own forwards (its all-reduce and gather) back around the packed ones.
* :class:`TPGroup`: the step message, one pickled broadcast from rank 0 per step over a gloo group.
* On CPU, the row-wise layers' sums and the logits' gather through shared memory
  (:mod:`replica.worker.shm_all_reduce`) instead of gloo.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Seconds a collective of the model waits for a peer before it raises: a rank that hangs or died
# fails the step (and the replica's health check) instead of blocking it forever.
COLLECTIVE_TIMEOUT_S = 60.0
# The other ranks wait for rank 0's next command as long as the replica idles; they still end at
# once when rank 0 dies (its connections close).
MESSAGE_TIMEOUT = datetime.timedelta(days=365)
# Bytes of rank 0's message one broadcast carries (a decode step's inputs take a few KB).
MESSAGE_BYTES = 1 << 16


@dataclass
class TPGroup:
    """This process's place in its replica's tensor-parallel group.

    ``rank`` 0 schedules and samples; ``message_group`` is the gloo group of the same ranks that
    carries rank 0's commands (beside the model's group: gloo on CPU, NCCL on CUDA), with a timeout
    long enough for an idle replica.
    """

    rank: int
    world_size: int
    message_group: object
    ranks: list = field(default_factory=list)  # rank 0: a handle per other rank, each with is_alive()
    broken: bool = False  # a forward failed here: the ranks' collectives no longer pair up
    _buffer: torch.Tensor | None = field(default=None, repr=False)  # the step message's

    def ranks_alive(self) -> bool:
        """Rank 0: whether every other rank's process or actor still runs."""
        return all(handle.is_alive() for handle in self.ranks)

    def broadcast(self, message=None):
        """Rank 0 sends ``message`` (any picklable object), the other ranks return it: pickled
        into a buffer of :data:`MESSAGE_BYTES` (its length first), so that a step's message is one
        gloo broadcast (``broadcast_object_list`` makes two: the size, then the data); a longer
        one takes a second broadcast for the rest. Raises ``RuntimeError`` (from gloo) when a
        peer's connection has closed (its process ended); a live rank that hangs is caught by the
        model's collectives (:data:`COLLECTIVE_TIMEOUT_S`, the shared-memory all-reduce's
        timeout), not here, where the other ranks wait as long as rank 0 idles
        (:data:`MESSAGE_TIMEOUT`)."""
        import pickle

        if self._buffer is None:
            self._buffer = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        buffer, room = self._buffer, MESSAGE_BYTES - 8
        data = b""
        if self.rank == 0:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            buffer[:8].view(torch.int64)[0] = len(data)
            head = data[:room]
            buffer[8 : 8 + len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        dist.broadcast(buffer, src=0, group=self.message_group)
        size = int(buffer[:8].view(torch.int64)[0])
        rest = torch.empty(max(0, size - room), dtype=torch.uint8)
        if rest.numel():
            if self.rank == 0:
                rest.copy_(torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8))
            dist.broadcast(rest, src=0, group=self.message_group)
        if self.rank == 0:
            return message
        return pickle.loads(buffer[8 : 8 + min(size, room)].numpy().tobytes() + rest.numpy().tobytes())

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank holds (every rank calls it)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.message_group)
        return int(tensor.item())

    def close(self) -> None:
        """Leave the process group (every rank's last collective call)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def abandon_group(tp: TPGroup) -> None:
    """Rank 0 gone without a word (its engine garbage-collected, or the interpreter exiting): kill
    the other ranks and leave the group."""
    for handle in tp.ranks:
        handle.kill()
    tp.close()


def init_tp_group(rank: int, world_size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the replica's process group (``init_method``: ``tcp://host:port`` of rank 0): the
    model's collectives on the default group (NCCL on CUDA, gloo on CPU), rank 0's commands on a
    gloo group of the same ranks.
    Raises ``RuntimeError`` (from torch) when the other ranks do not join within
    :data:`COLLECTIVE_TIMEOUT_S`."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ["LOCAL_RANK"] = str(device.index or 0)  # the device transformers binds its mesh to
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    return TPGroup(rank, world_size, dist.new_group(backend="gloo", timeout=MESSAGE_TIMEOUT))


def sharded(tp_size: int) -> dict:
    """``from_pretrained``'s arguments for transformers' tensor-parallel plan over the current
    process group (``tp_size`` ranks: the whole group); the model's sharded parameters are
    ``DTensor``\\ s until :func:`localize`."""
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=tp_size)}


def localize(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """Turn every sharded (``DTensor``) parameter into its local shard (the whole tensor for the
    input embedding, which stays replicated) and take the library's forward off each layer of the
    tensor-parallel plan. Returns ``(module, style)`` pairs for
    :func:`install_forwards`. Linear layers keep their global ``in_features``/``out_features``
    (the library's forwards read them); their weights hold the local rows or columns, and
    ``carpool_tp_part`` says which: ``(dim, rank, world)``, ``dim`` 0 for a column-wise style
    (this rank's part of the rows: :func:`replica.quant.blocks.part_bounds`), 1 for a row-wise
    one (of the inputs), None for another style (packed, or heads replicated over ranks); a
    quantized layer loaded whole cuts its part by it (:func:`replica.quant.blocks.shard_blocks`)."""
    from torch.distributed.tensor import DTensor
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard

    plan = model.tp_plan
    rank, world = dist.get_rank(), dist.get_world_size()
    hooked = []
    for name, module in model.named_modules():
        style_name = plan.get(replace_layer_number_by_wildcard(name))
        # The input embedding is replicated: a lookup, which sharding would turn into a masked
        # lookup and an all-reduce per step to save memory only. (It may also hold a sharded
        # weight without a style of its own: the output embedding's, tied.)
        whole = style_name is None or isinstance(module, torch.nn.Embedding)
        for param_name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                local = param.full_tensor() if whole else param.to_local()
                module._parameters[param_name] = torch.nn.Parameter(local, requires_grad=False)
        if not whole and isinstance(module, torch.nn.Linear):
            module.carpool_tp_part = _part_of(module, ALL_PARALLEL_STYLES[style_name], rank, world)
        if whole:
            module.__dict__.pop("forward", None)
        elif "forward" in module.__dict__:
            del module.forward  # the library's wrapper; install_forwards puts it back
            hooked.append((module, ALL_PARALLEL_STYLES[style_name]))
    return hooked


def _part_of(module: torch.nn.Linear, style, rank: int, world: int) -> tuple[int | None, int, int]:
    """``(dim, rank, world)`` of a sharded linear layer (see :func:`localize`): ``dim`` 0 or 1 for
    transformers' plain column- and row-wise styles, where the local weight (if the layer has a
    dense one) is the part :func:`~replica.quant.blocks.part_bounds` gives; else None."""
    from transformers.integrations.tensor_parallel import ColwiseParallel, RowwiseParallel

    from replica.quant.blocks import part_bounds

    dim = {ColwiseParallel: 0, RowwiseParallel: 1}.get(type(style))
    weight = module._parameters.get("weight")
    if dim is not None and weight is not None and weight.dim() == 2:
        full = (module.out_features, module.in_features)[dim]
        if weight.shape[dim] != part_bounds(full, rank, world)[1]:
            dim = None
    return dim, rank, world


def install_forwards(hooked: list[tuple[torch.nn.Module, object]], device: torch.device, reducer=None) -> None:
    """Wrap each layer's current forward (prepacked or torch's) in its style's forward again:
    the same all-reduce after row-wise layers and gather after the output embedding as the
    library's, around whatever computes the local shard. With ``reducer`` (a
    :class:`~replica.worker.shm_all_reduce.ShmAllReduce`, CPU), the row-wise layers sum through it
    instead of the process group, as the library's inference path does: the local product, the
    sum, then the bias once; and the output embedding (column-wise, its output gathered, in equal
    shares) gathers its logits through it onto rank 0, the one rank that samples from them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from transformers.integrations.tensor_parallel import ColwiseParallel, RowwiseParallel

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    world = dist.get_world_size()
    for module, style in hooked:
        if reducer is not None and isinstance(style, RowwiseParallel) and style.output_layouts == Replicate():
            _sum_through(module, reducer)
        elif (reducer is not None and isinstance(style, ColwiseParallel) and style.output_layouts == Replicate()
              and isinstance(module, torch.nn.Linear) and module.out_features % world == 0):
            _gather_through(module, reducer, world)
        else:
            style.install_forward(module, mesh)


def _sum_through(module: torch.nn.Linear, reducer) -> None:
    local, bias = module.forward, module.bias
    module.bias = None  # added once, after the sum

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.carpool.shm_all_reduce(local(x), reducer.key)
        return out if bias is None else out + bias

    module.forward = forward


def _gather_through(module: torch.nn.Linear, reducer, world: int) -> None:
    local = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.carpool.shm_gather(local(x), reducer.key, world)

    module.forward = forward


def shared_reducer(tp: TPGroup, hidden_bytes: int, logits_bytes: int = 0, max_tokens: int = 512):
    """A :class:`~replica.worker.shm_all_reduce.ShmAllReduce` for ``tp`` (every rank calls this at
    the same point), for steps of up to ``max_tokens`` rows of ``hidden_bytes`` and gathers of up
    to ``logits_bytes`` per rank (a decode step's logits: seats × the rank's share of the
    vocabulary); None on every rank where shared memory cannot serve one of them (no ``/dev/shm``,
    not x86-64, no room)."""
    from replica.worker import shm_all_reduce

    path = tp.broadcast(f"/dev/shm/carpool-tp-{os.getpid()}-{id(tp)}" if tp.rank == 0 else None)
    max_bytes = max(hidden_bytes * max_tokens, logits_bytes)
    reducer = None
    if shm_all_reduce.available():
        if tp.rank == 0:
            try:
                with open(path, "wb") as f:
                    f.truncate(shm_all_reduce.buffer_bytes(tp.world_size, max_bytes))
            except OSError as exc:
                logger.warning("no shared memory for the all-reduce (%s): gloo sums instead", exc)
        tp.min_over_ranks(1)  # the file is made (or not) before anyone opens it
        try:
            alive = tp.ranks_alive if tp.rank == 0 else None
            reducer = shm_all_reduce.ShmAllReduce(tp.rank, tp.world_size, path, max_bytes, alive)
        except (OSError, RuntimeError):
            reducer = None
    everywhere = tp.min_over_ranks(int(reducer is not None))
    if tp.rank == 0 and os.path.exists(path):
        os.unlink(path)  # every rank has mapped it (or given up)
    return reducer if everywhere else None
