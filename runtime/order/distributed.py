"""Rank and world size, from arguments or from an initialized torch.distributed."""

from __future__ import annotations

import torch.distributed as dist


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        return (
            dist.get_rank() if rank is None else rank,
            dist.get_world_size() if world_size is None else world_size,
        )
    if rank is not None or world_size is not None:
        raise ValueError(
            "give both rank and world_size, or neither (then torch.distributed decides)"
        )
    return 0, 1
