"""Which batches the next optimizer step trains, decided alike on every data-parallel rank.

A batch with a failed attempt (a step that trained it never finished: the trainer died or
raised) is a suspect. It trains in a step of its own, alone on the whole job, so that a good
batch that shared the failing step with a poison one is not blamed again: the poison batch
fails alone each time and reaches ``max_attempts``, the good one succeeds on its retry.

Every rank contributes the figures of :func:`local_view`; one all-reduce (MAX) combines
them; :func:`decide` turns the combined figures into the same plan on every rank. Ranks may
train different numbers of micro-batches in one step: each runs ``passes`` forward and
backward passes (FSDP's collectives need the same number everywhere), the missing ones on
no batch with zero weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STOP, SAVING, WAITING, TAKE = range(4)
"""Positions of the flags and of this rank's step size in :func:`local_view`; the one-hot
of the ranks whose next batch is a suspect follows."""


@dataclass(frozen=True)
class StepPlan:
    stop: bool
    """Some rank was asked to stop: the loop ends (after settling what is in flight)."""
    saving: bool
    """An asynchronous resume checkpoint is still being written on some rank."""
    take: int
    """How many of this rank's buffered batches (from the front) the step trains."""
    passes: int
    """Forward/backward passes every rank runs; 0 means there is no step this round."""


def local_view(
    attempts: Sequence[int],
    micro_batches: int,
    rank: int,
    world: int,
    stop: bool,
    saving: bool,
) -> list[float]:
    """This rank's figures: ``attempts`` are the failed attempts of its buffered batches in
    order. A step without suspects takes the leading batches that are not suspects, up to
    ``micro_batches``; it is ready once it has them all, or stopped short of a suspect."""
    clean = 0
    for count in attempts[:micro_batches]:
        if count:
            break
        clean += 1
    suspect_first = bool(attempts) and attempts[0] > 0
    ready = suspect_first or clean == micro_batches or clean < len(attempts)
    suspects = [0.0] * world
    suspects[rank] = float(suspect_first)
    return [float(stop), float(saving), float(not ready), float(clean), *suspects]


def decide(combined: Sequence[float], local: Sequence[float], rank: int) -> StepPlan:
    """The plan from ``combined``, the MAX over ranks of every rank's :func:`local_view`,
    and ``local``, this rank's own.

    A suspect anywhere wins: the lowest rank holding one trains it alone in one pass, the
    others take nothing. Otherwise every rank must be ready, and each takes its clean lead.
    """
    stop, saving = bool(combined[STOP]), bool(combined[SAVING])
    suspects = [i for i, flag in enumerate(combined[TAKE + 1 :]) if flag]
    if suspects:
        return StepPlan(stop, saving, take=int(rank == suspects[0]), passes=1)
    if combined[WAITING]:
        return StepPlan(stop, saving, take=0, passes=0)
    return StepPlan(stop, saving, take=int(local[TAKE]), passes=int(combined[TAKE]))
