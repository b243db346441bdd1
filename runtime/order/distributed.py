"""Rank, world size and nodes, from arguments or from an initialized torch.distributed
(and, for nodes, the environment torchrun gives each rank)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.utils.data import get_worker_info

from ..errors import UsageError, check_int
from .epochs import OrderSpec


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


def placement(
    rank: int | None,
    world_size: int | None,
    nodes: int | None,
    node_rank: int | None,
    owner: str = "Loader",
) -> tuple[int, int, int]:
    """(rank, world size, nodes) of this process, each checked: given, or from an
    initialized torch.distributed and the launcher's environment (``node_count``)."""
    grouped = rank is None and world_size is None
    got_rank, world = rank_and_world(rank, world_size)
    world = check_int(f"{owner} world_size", world, low=1)
    got_rank = check_int(f"{owner} rank", got_rank, low=0, high=world - 1)
    count = node_count(got_rank, world, nodes, node_rank, owner, from_group=grouped)
    return got_rank, world, count


def launcher_nodes(env: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """(ranks per node, node rank, local rank) as torchrun (and launchers like it) tell
    each rank: ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (or ``NODE_RANK``), ``LOCAL_RANK``;
    None where they are not all set. Malformed values are refused, naming the variable."""
    env = os.environ if env is None else env
    node_key = "GROUP_RANK" if "GROUP_RANK" in env else "NODE_RANK"
    keys = ("LOCAL_WORLD_SIZE", node_key, "LOCAL_RANK")
    if not all(k in env for k in keys):
        return None
    values = []
    for key in keys:
        try:
            values.append(int(env[key]))
        except ValueError:
            raise UsageError(
                f"environment variable {key}={env[key]!r} is not a whole number"
            ) from None
    local, node, local_rank = values
    if local < 1 or node < 0 or not 0 <= local_rank < local:
        raise UsageError(
            f"the launcher's environment is not a node layout: LOCAL_WORLD_SIZE={local}, "
            f"{node_key}={node}, LOCAL_RANK={local_rank}"
        )
    return local, node, local_rank


def node_count(
    rank: int,
    world_size: int,
    nodes: int | None,
    node_rank: int | None,
    owner: str = "Loader",
    env: Mapping[str, str] | None = None,
    from_group: bool = True,
) -> int:
    """How many nodes the ``world_size`` ranks span, ranks numbered node by node (rank =
    node * ranks_per_node + local rank): ``nodes`` when given (``node_rank``, when given
    too, must be the node of ``rank``); else, when the rank and world size are the
    initialized torch.distributed's (``from_group``: the caller gave neither), what the
    launcher's environment says (``launcher_nodes``); else 1 (ranks the caller numbered
    itself, as data-parallel ranks under model parallelism, say nothing of nodes). A
    layout that disagrees with the rank and world size is refused."""
    if nodes is None:
        if node_rank is not None:
            raise UsageError(f"{owner} node_rank= needs nodes= (how many nodes there are)")
        grouped = from_group and dist.is_available() and dist.is_initialized()
        told = launcher_nodes(env) if grouped else None
        if told is None:
            return 1
        local, node, local_rank = told
        if world_size % local or rank // local != node or rank % local != local_rank:
            raise UsageError(
                f"{owner}: the launcher's environment (LOCAL_WORLD_SIZE={local}, node "
                f"{node}, LOCAL_RANK={local_rank}) disagrees with rank {rank} of world_size "
                f"{world_size}: ranks are numbered node by node; pass nodes= and node_rank= "
                "to say how the ranks are laid out, or nodes=1 to deal no shards to nodes"
            )
        return world_size // local
    nodes = check_int(f"{owner} nodes", nodes, low=1)
    if world_size % nodes:
        raise UsageError(
            f"{owner} nodes={nodes} does not divide world_size={world_size}: every node "
            "runs the same number of ranks"
        )
    if node_rank is not None:
        node_rank = check_int(f"{owner} node_rank", node_rank, low=0, high=nodes - 1)
        local = world_size // nodes
        if rank // local != node_rank:
            raise UsageError(
                f"{owner} node_rank={node_rank} disagrees with rank {rank}: with "
                f"{local} ranks on each of {nodes} nodes, rank {rank} is on node "
                f"{rank // local} (ranks are numbered node by node)"
            )
    return nodes


def agree_across_ranks(
    state: Mapping[str, object] | None, spec: OrderSpec, grouped: bool, what: str
) -> None:
    """Under an initialized process group that placed this reader (``grouped``: its rank
    and world came from it), compares the positions every rank is loading (epoch, batches
    done, the world it was saved in and earlier ones): ranks step together, so a rank one
    batch behind its peers (a state saved by one rank after a failure) would repeat or
    skip data. Every rank calls ``load_state_dict``, as a resume does, and each takes
    part even when its own state was refused (``state`` None: it raises its own error
    after): no rank waits on one that gave up. Raises UsageError here, naming each rank's
    position, when a rank refused its state or the positions disagree. With
    ``even_shares=False`` the ranks' positions may differ at an epoch's end, and are not
    compared."""
    if not grouped or not spec.even_shares or get_worker_info() is not None:
        return  # a forked DataLoader worker sees its parent's group, and is none of it
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() != spec.world_size or dist.get_rank() != spec.rank:
        return
    values = [0, -1, -1, 0]
    if state is not None:
        shape = [state.get(k) for k in ("earlier", "world_size", "nodes", "batch_size")]
        digest = hashlib.sha256(json.dumps(shape, default=repr).encode()).digest()
        values = [1, _int(state.get("epoch")), _int(state.get("batches_done"))]
        values.append(int.from_bytes(digest[:7]))
    mine = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend() == "nccl":
        mine = mine.cuda()  # the rank's device, as set for NCCL (torch.cuda.set_device)
    got = [torch.zeros_like(mine) for _ in range(spec.world_size)]
    dist.all_gather(got, mine)
    if state is None:
        return
    positions = [tuple(int(v) for v in t.tolist()) for t in got]
    refused = [r for r, p in enumerate(positions) if not p[0]]
    if refused:
        raise UsageError(
            f"{what} state: rank(s) {refused} refused theirs, so no rank resumes (the ranks "
            "step together); see their errors"
        )
    if len(set(positions)) > 1:
        told = "; ".join(
            f"rank {r}: epoch {p[1]} after {p[2]} batches"
            + (" (saved in another world)" if p[3] != positions[0][3] else "")
            for r, p in enumerate(positions)
        )
        raise UsageError(
            f"{what} states loaded by the ranks disagree ({told}); the ranks step together, "
            "so each must load the same position: load one rank's state (rank 0's) into "
            "every rank"
        )


def _int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    return -1
