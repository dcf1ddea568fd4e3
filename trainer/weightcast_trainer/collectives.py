"""What the trainer's ranks exchange: flags, sums and applied ids, always as tensors.

Every function is a collective: every rank calls it at the same point of the loop. In a
world of one they return at once. Nothing is pickled (no ``all_gather_object``).
"""

from __future__ import annotations

import torch

from weightcast_trainer.resume import encode_ids


def world_size() -> int:
    return torch.distributed.get_world_size()


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over all ranks (a flag true anywhere is true everywhere)."""
    if world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.tolist()


def sum_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each named value's sum over all ranks, in one all-reduce."""
    if world_size() == 1:
        return dict(values)
    tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor)
    return dict(zip(values, tensor.tolist(), strict=True))


def gather_ids(entry_ids: list[str], device: torch.device) -> torch.Tensor:
    """Every rank's applied ids of this step, rank by rank, as an int64 ``[N, 2]`` tensor.

    Ranks may apply different numbers of entries in a step (a suspect trains alone), so the
    counts are gathered first and the ids padded to the largest.
    """
    ids = encode_ids(entry_ids)
    world = world_size()
    if world == 1:
        return ids
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    torch.distributed.all_gather(counts, torch.tensor([len(ids)], device=device))
    largest = max(int(c.item()) for c in counts)
    padded = torch.zeros(largest, 2, dtype=torch.int64)
    padded[: len(ids)] = ids
    parts = [torch.empty_like(padded, device=device) for _ in range(world)]
    torch.distributed.all_gather(parts, padded.to(device))
    return torch.cat([p[: int(n.item())].cpu() for p, n in zip(parts, counts, strict=True)])


def broadcast_bytes(data: bytes, device: torch.device) -> bytes:
    """Rank 0's ``data`` on every rank (all ranks pass bytes of the same length)."""
    token = torch.tensor(list(data), dtype=torch.uint8, device=device)
    if world_size() > 1:
        torch.distributed.broadcast(token, src=0)
    return bytes(token.tolist())
