"""Which batches the next step trains on each rank, as pure functions of the ranks' buffers."""

from __future__ import annotations

from weightcast_trainer.step_plan import StepPlan, decide, local_view


def plans(buffers: list[list[int]], micro_batches: int) -> list[StepPlan]:
    """Every rank's plan, the MAX all-reduce done by hand. Buffers list failed attempts."""
    world = len(buffers)
    views = [
        local_view(attempts, micro_batches, rank, world, stop=False, saving=False)
        for rank, attempts in enumerate(buffers)
    ]
    combined = [max(column) for column in zip(*views, strict=True)]
    return [decide(combined, view, rank) for rank, view in enumerate(views)]


def test_clean_batches_fill_a_step_on_every_rank() -> None:
    assert plans([[0, 0, 0]], 2) == [StepPlan(False, False, take=2, passes=2)]
    assert [p.take for p in plans([[0, 0], [0, 0]], 2)] == [2, 2]


def test_every_rank_waits_until_each_has_its_micro_batches() -> None:
    assert [p.passes for p in plans([[0, 0], [0]], 2)] == [0, 0]
    assert [p.passes for p in plans([[], [0]], 1)] == [0, 0]


def test_a_suspect_trains_alone_on_the_whole_job() -> None:
    """The lowest rank with a suspect first trains it alone; the others idle one pass."""
    assert plans([[1, 0]], 2) == [StepPlan(False, False, take=1, passes=1)]
    assert [(p.take, p.passes) for p in plans([[0, 0], [2], [1]], 2)] == [(0, 1), (1, 1), (0, 1)]
    # Even a rank still waiting for batches does not hold a suspect back.
    assert [(p.take, p.passes) for p in plans([[], [1]], 2)] == [(0, 1), (1, 1)]


def test_a_step_stops_short_of_a_suspect() -> None:
    """Clean batches before a suspect train without it; ranks run as many passes as the
    busiest one."""
    assert [(p.take, p.passes) for p in plans([[0, 3, 0], [0, 0]], 2)] == [(1, 2), (2, 2)]


def test_stop_and_saving_flags_reach_every_rank() -> None:
    views = [
        local_view([0], 1, 0, 2, stop=True, saving=False),
        local_view([0], 1, 1, 2, False, True),
    ]
    combined = [max(column) for column in zip(*views, strict=True)]
    assert all(
        decide(combined, v, r).stop and decide(combined, v, r).saving for r, v in enumerate(views)
    )
