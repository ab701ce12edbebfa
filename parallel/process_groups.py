"""Process groups: the default group from torchrun's environment and megatron-core's parallel
groups for a ``ParallelConfig``, created once per job after the layout has been validated.

Our modules take the groups they use as arguments (``ProcessGroupCollection`` from megatron-core,
built by ``groups()``), never from megatron-core's globals at the call site.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from parallel.layout import ParallelConfig

# The sizes megatron-core's initialize_model_parallel takes, by their (shared) names in
# ParallelConfig.mcore_kwargs().
GROUP_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "virtual_pipeline_model_parallel_size", "context_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size")


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; 1 process without it."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(par: ParallelConfig, seed: int) -> None:
    """Create the default group and megatron-core's parallel groups; seed its RNG tracker."""
    rank, world, local_rank = world_from_env()
    backend = par.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend=backend, store=_attempt_store(rank, world), rank=rank,
                                world_size=world)
    sizes = par.mcore_kwargs()
    parallel_state.initialize_model_parallel(
        **{name: sizes[name] for name in GROUP_SIZES}, get_embedding_ranks=first_stage_only)
    model_parallel_cuda_manual_seed(seed)


def _attempt_store(rank: int, world: int) -> dist.Store:
    """torchrun's rendezvous store with its keys prefixed by the restart attempt. A worker
    group restarted by ``torchrun --max-restarts`` creates its groups under the same names, on
    the same store (the agent keeps it), as the attempt before; a rank reaching a group before
    its peer has re-published its address there would read the dead worker's address (gloo:
    "connection refused", the restart fails)."""
    store, _, _ = next(dist.rendezvous(f"env://?rank={rank}&world_size={world}"))
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def first_stage_only(pp_ranks: list[int], *_) -> list[int]:
    """megatron-core's embedding group, reduced to the first stage: copies of the word
    embedding (MTP stage, tied head) are tied by ``parallel.embedding_tie.EmbeddingTie``
    instead, which also handles two copies on one rank (megatron-core deadlocks on those)."""
    return [pp_ranks[0]]


def destroy_distributed() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def groups() -> ProcessGroupCollection:
    """Every megatron-core group of this rank, as one object to pass down explicitly."""
    return ProcessGroupCollection.use_mpu_process_groups()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A world-size-1 gloo group plus megatron-core's parallel state (all sizes 1)."""
    port = _free_port()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
