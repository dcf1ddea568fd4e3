"""Copy one rank's staged parts into live parameters, in place (no vLLM import).

The backend's ``inplace`` mode: each part lands in the leading rows of the parameter of its
name, byte for byte; the rows after it (vocabulary padding) are zeroed, as vLLM loads them.
The parameters keep their storage (``data_ptr``), so CUDA graphs captured on them replay the
new weights, and a tied ``lm_head`` (the embedding's own tensor) stays tied.

Into a GPU, the parts (pageable host memory, as the reader returns them) go through a ring
of pinned staging buffers allocated once per :class:`InPlaceCopier`: the CPU fills one slot
while the copy engine drains another, with non-blocking copies on the current stream.
A blocking copy from pageable memory per tensor runs several times slower.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

STAGING_SLOT_BYTES = 64 << 20
"""One pinned staging slot: a power of two, so the pinned allocator rounds nothing up."""

STAGING_SLOTS = 3
"""Slots in the ring: enough that filling one never waits for the copy of the previous."""


class InPlaceCopier:
    """Copies parts into parameters; for GPU parameters through pinned staging slots it
    allocates on first use and keeps for later updates."""

    def __init__(self, slot_bytes: int = STAGING_SLOT_BYTES, slots: int = STAGING_SLOTS) -> None:
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._staging: list[torch.Tensor] = []
        self._ready: list[torch.cuda.Event | None] = []
        self.staging_allocations = 0
        """How many times the pinned slots were allocated (once per copier)."""

    @torch.no_grad()
    def copy(
        self, params: Mapping[str, torch.Tensor], parts: Iterable[tuple[str, torch.Tensor]]
    ) -> int:
        """Copy each ``(name, part)`` into ``params[name]``; the bytes copied. Returns once
        every parameter holds its part (the staging slots are free again).

        Raises ``KeyError`` for a name with no parameter and ``ValueError`` for a part that
        does not fit (another dtype, other trailing dimensions, more rows).
        """
        copied = 0
        pending: list[torch.cuda.Event] = []
        for name, part in parts:
            param = params[name]
            target = _leading_rows(param, part, name)
            if param.device.type == "cuda" and part.device.type == "cpu":
                pending += self._through_staging(part, target)
            else:
                target.copy_(part, non_blocking=True)
            param[part.shape[0] :].zero_()  # vocabulary padding: zero, as vLLM loads it
            copied += part.numel() * part.element_size()
        for event in pending:
            event.synchronize()
        return copied

    def _through_staging(self, part: torch.Tensor, target: torch.Tensor) -> list[torch.cuda.Event]:
        """Fill pinned slots from ``part`` and copy each to its place in ``target`` without
        blocking; the events of the slots used."""
        if not self._staging:
            self._staging = [
                torch.empty(self.slot_bytes, dtype=torch.uint8, device="cpu", pin_memory=True)
                for _ in range(self.slots)
            ]
            self._ready = [None] * self.slots
            self.staging_allocations += 1
        source = part.contiguous().view(-1).view(torch.uint8)
        dest = target.view(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(target.device)
        used = []
        for index, start in enumerate(range(0, len(source), self.slot_bytes)):
            slot = index % self.slots
            if self._ready[slot] is not None:
                self._ready[slot].synchronize()  # its previous copy has left the slot
            piece = source[start : start + self.slot_bytes]
            staged = self._staging[slot][: len(piece)]
            staged.copy_(piece)
            dest[start : start + len(piece)].copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            self._ready[slot] = event
            used.append(event)
        return used


def _leading_rows(param: torch.Tensor, part: torch.Tensor, name: str) -> torch.Tensor:
    """The rows of ``param`` that ``part`` overwrites (its first ``len(part)``)."""
    if part.dtype != param.dtype:
        raise ValueError(f"{name}: the part is {part.dtype}, the parameter {param.dtype}")
    if tuple(part.shape[1:]) != tuple(param.shape[1:]) or part.shape[0] > param.shape[0]:
        raise ValueError(
            f"{name}: a part of {list(part.shape)} does not fit the parameter's {list(param.shape)}"
        )
    if not param.is_contiguous():
        raise ValueError(f"{name}: the parameter is not contiguous; it cannot be copied in place")
    return param[: part.shape[0]]
