"""Several processes under torchrun: data parallel with the gradients averaged by hand after the backward passes (what
DDP does, written out), or FSDP2 (--fsdp: weights, gradients and optimizer state sharded). Without torchrun every
function here is the identity and a script runs as one process.

Under `torchrun --nproc-per-node N` each process (rank) samples its contiguous share of a step's prompts (`shard`),
computes its loss on them, and `average_gradients` makes every gradient the mean over the ranks, so that an update
equals one process's update on the union of the ranks' rollouts. Normalisers that span the whole batch in an algorithm
(a token mean, PPO's whitening) use `global_count_per_rank` and `concat_over_ranks`; rank 0 alone writes files."""

import atexit
import os
import time
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as torch_dist

from plumbing import lora

_single_process = False  # inside `as_single_process()`: this rank works alone (rank 0 building a cache)


def world_size() -> int:
    """The number of processes of this run: torchrun's WORLD_SIZE, 1 without torchrun."""
    return 1 if _single_process else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return 0 if _single_process else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Whether this process writes files and prints (rank 0, or the only process)."""
    return rank() == 0


def init_device(name: str) -> torch.device:
    """The device of this process for --device auto (CUDA when available), cpu or cuda. Under torchrun it is this
    process's GPU (LOCAL_RANK) or the CPU, and the first call joins the run's process group (NCCL on GPUs, gloo on CPUs)."""
    device = torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")
    if world_size() > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        if not torch_dist.is_initialized():
            # torch.distributed.nn (FSDP imports it) takes the process group as a default argument when first imported:
            # imported after init_process_group, it keeps the group and its gloo threads alive past
            # destroy_process_group, and a thread still releasing the last collective's tensors when Python shuts
            # down aborts the process ("terminate called without an active exception"). Imported first, it holds none.
            import torch.distributed.nn as _  # noqa: F401

            torch_dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            atexit.register(leave_process_group)
    return device


def leave_process_group() -> None:
    """At exit: leave the process group, if it is still there (a script may have left it already). gloo's threads free a
    collective's tensors after it has returned, which needs the GIL; one still waiting for it when Python shuts down
    aborts the process. A moment's sleep (the GIL released) lets them finish first: destroy_process_group does not stop
    them while something else (FSDP2, after fully_shard) still holds the group."""
    if torch_dist.is_initialized():
        time.sleep(0.1)
        torch_dist.destroy_process_group()


@contextmanager
def as_single_process():
    """Rank 0 builds something once (the built-in warm-up, the preference pairs) while the other ranks wait in
    `wait_for_file`: inside this block its functions run as one process's would, without collectives."""
    global _single_process
    _single_process, before = True, _single_process
    try:
        yield
    finally:
        _single_process = before


def barrier() -> None:
    if world_size() > 1:
        torch_dist.barrier()


def wait_for_file(path: str) -> None:
    """The ranks other than 0 wait until rank 0 has built `path` (moved into place when complete), polling the file
    system rather than waiting in a collective, which would time out (after 10 minutes with NCCL) on a long build."""
    while not is_main() and not os.path.exists(path):
        time.sleep(2)
    barrier()


def _on_comm_device(x: torch.Tensor) -> torch.Tensor:
    """A copy of x on the device the process group communicates on (NCCL needs CUDA tensors)."""
    return x.to("cuda" if torch_dist.get_backend() == "nccl" else "cpu", copy=True)


def all_reduce(x, op: str = "sum") -> torch.Tensor:
    """The sum (or "min", "max") over ranks of x, on x's device; x itself without torchrun."""
    x = torch.as_tensor(x)
    if world_size() == 1:
        return x
    y = _on_comm_device(x)
    torch_dist.all_reduce(
        y, {"sum": torch_dist.ReduceOp.SUM, "min": torch_dist.ReduceOp.MIN, "max": torch_dist.ReduceOp.MAX}[op]
    )
    return y.to(x.device)


def mean_over_ranks(x) -> torch.Tensor:
    return all_reduce(x) / world_size()


def global_count_per_rank(count: torch.Tensor) -> torch.Tensor:
    """The normaliser of a mean over the whole batch (e.g. over its valid tokens), as each rank's share: the count summed
    over all ranks (at least 1), divided by the number of ranks; in one process, max(count, 1). A rank's sum divided by
    it, once the gradients are averaged over the ranks, is the sum over all ranks divided by their total count."""
    return mean_over_ranks(count).clamp(min=1 / world_size())


def true_on_every_rank(flag: bool) -> bool:
    """Whether flag holds on every rank (flag itself without torchrun): for decisions all ranks must take together."""
    return bool(all_reduce(torch.tensor(int(flag)), "min")) if world_size() > 1 else bool(flag)


def concat_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The 1-D tensors x of every rank (their lengths may differ), concatenated in rank order; x without torchrun."""
    if world_size() == 1:
        return x
    sizes = [_on_comm_device(torch.zeros(1, dtype=torch.long)) for _ in range(world_size())]
    torch_dist.all_gather(sizes, _on_comm_device(torch.tensor([len(x)])))
    width = int(max(s.item() for s in sizes))
    padded = _on_comm_device(torch.cat([x.detach(), x.new_zeros(width - len(x))]))
    pieces = [torch.empty_like(padded) for _ in sizes]
    torch_dist.all_gather(pieces, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(pieces, sizes)]).to(x.device)


def gather_objects(obj) -> list:
    """The picklable obj of every rank, in rank order ([obj] without torchrun)."""
    if world_size() == 1:
        return [obj]
    objects = [None] * world_size()
    torch_dist.all_gather_object(objects, obj)
    return objects


def shard(items):
    """This rank's contiguous share of a global list or tensor (the whole of it without torchrun): rank r gets the
    r-th of world_size() equal parts. The length must be a multiple of world_size() (checked with the flags)."""
    size = len(items) // world_size()
    return items[rank() * size : (rank() + 1) * size]


def prepare_models(args, *models):
    """Under torchrun, before the optimizer is created: without --fsdp every trained model takes rank 0's weights (so
    that the ranks start equal; `average_gradients` keeps them equal), and frozen ones (the reference) stay as loaded.
    With --fsdp every model is sharded with FSDP2: each transformer layer (the model's `_no_split_modules`) is one unit,
    the rest of the model (embeddings, final norm, output layer) the root unit; FSDP2 gathers a unit's weights in its
    forward pass, so the model must be called as `model(...)`, as common.py does; the root unit stays gathered from its
    forward to its backward, so that common.completion_logprobs can run the output layer after the forward has returned.
    FSDP2 leaves the weights as they were loaded (pretrained or zero-initialised, the same on every rank). Returns the
    models (the same objects)."""
    if world_size() == 1:
        return models
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    for model in models:
        if model is None:
            continue
        if not getattr(args, "fsdp", False):
            for p in model.parameters():
                if p.requires_grad:
                    torch_dist.broadcast(p.data, src=0)
            continue
        mesh = init_device_mesh(next(model.parameters()).device.type, (world_size(),))  # on this run's device
        layer_types = {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or []}
        for module in model.modules():
            if type(module).__name__ in layer_types:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)  # the output layer runs after the forward returns
    # our outputs (log-probs, values) are never changed in place, which FSDP2 warns about for views
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return models


def average_gradients(optimizer) -> None:
    """Under torchrun, after a step's backward passes: every gradient of the parameters the optimizer trains becomes its
    mean over the ranks (one all_reduce each, as DDP does in buckets), so that every rank takes the same step. FSDP2's
    sharded gradients were already averaged during the backward pass and are left as they are."""
    if world_size() == 1:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if is_dtensor(p) or not p.requires_grad:  # FSDP2's own, or frozen (--lora-rank)
                continue
            if p.grad is None:  # every rank must join every all_reduce
                p.grad = torch.zeros_like(p)
            torch_dist.all_reduce(p.grad)
            p.grad /= world_size()


def is_dtensor(x) -> bool:
    """Whether x is an FSDP2 shard, a DTensor (torch.distributed.tensor, slow to import, is not imported here)."""
    return hasattr(x, "device_mesh") and hasattr(x, "full_tensor")


def full_tensor(x):
    """A full plain tensor from x: an FSDP2 shard is gathered (every rank must call this), anything else is x itself."""
    return x.full_tensor() if is_dtensor(x) else x


def uses_fsdp(model) -> bool:
    """Whether the model's weights are sharded with FSDP2 (--fsdp under torchrun)."""
    return any(is_dtensor(p) for p in model.parameters())


def save_model(model, tokenizer, path: str) -> None:
    """save_pretrained of the model and its tokenizer, by rank 0; under FSDP2 the shards are gathered first, so that
    the folder loads with from_pretrained exactly like a single process's. With --lora-rank (never sharded: see
    checks.adapter_and_tracker) the adapter is saved, then merged into the weights, which are saved as the model."""
    if lora.has_adapter(model):
        if is_main():
            lora.save_merged(model, tokenizer, path)
        barrier()
        return
    state = {k: full_tensor(v) for k, v in model.state_dict().items()} if uses_fsdp(model) else None
    if is_main():
        model.save_pretrained(path, state_dict=state)
        tokenizer.save_pretrained(path)
    barrier()
