"""`RowBuffers`: a self-index layer's per-token tensors, grown together along the token axis, with the views and
in-place writes that fixed-shape decoding needs."""

from __future__ import annotations

import copy

import torch


class RowBuffers:
    """Named [B, H, capacity, c] tensors grown together along dim 2 by a fixed step (64 tokens: the slack stays
    small next to 4K+ tokens and appending stays cheap), to at least `reserve` rows (a length known ahead: no
    growth, and no copy, until it is reached)."""

    def __init__(self, reserve: int = 0, step: int = 64) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.length = 0
        self.reserve, self.step = reserve, step
        self.fixed_rows: int | None = None

    def append(self, **new: torch.Tensor) -> None:
        count = next(iter(new.values())).shape[2]
        needed = self.length + count
        for name, value in new.items():
            buf = self.tensors.get(name)
            if buf is None:
                self.tensors[name] = value.new_empty(*value.shape[:2], max(needed, self.reserve), *value.shape[3:])
            elif buf.shape[2] < needed:
                self._grow(name, needed)
            self.tensors[name][:, :, self.length : needed] = value
        self.length = needed

    def make_room(self, count: int) -> None:
        """Room for `count` more rows in every tensor, made at once: a long write that goes in parts (`append` of
        each) then grows the buffers once, not once a part. Before the first append, that append allocates it."""
        needed = self.length + count
        if not self.tensors:
            self.reserve = max(self.reserve, needed)
            return
        for name, buf in self.tensors.items():
            if buf.shape[2] < needed:
                self._grow(name, needed)

    def _grow(self, name: str, needed: int) -> None:
        """Tensor `name` copied into one of room for `needed` rows and a step more (or the reserve)."""
        buf = self.tensors[name]
        grown = buf.new_empty(*buf.shape[:2], max(needed + self.step, self.reserve), *buf.shape[3:])
        grown[:, :, : self.length] = buf[:, :, : self.length]
        self.tensors[name] = grown

    @property
    def view_length(self) -> int:
        """Rows a view shows: the tokens held, or the whole capacity during fixed-shape decoding (`fix`)."""
        return self.length if self.fixed_rows is None else self.fixed_rows

    def view(self, name: str) -> torch.Tensor:
        return self.tensors[name][:, :, : self.view_length]

    def fix(self, rows: int, slack: int = 0) -> None:
        """Fixed-shape decoding: room for `rows` rows plus `slack` rows past them (writes of whole blocks that
        may reach past the last row), zeros past the held ones, and views of all `rows` rows until `unfix`."""
        for name, buf in self.tensors.items():
            if buf.shape[2] < rows + slack:
                grown = buf.new_zeros(*buf.shape[:2], rows + slack, *buf.shape[3:])
                grown[:, :, : self.length] = buf[:, :, : self.length]
                self.tensors[name] = grown
            else:
                buf[:, :, self.length :].zero_()
        self.fixed_rows = rows

    def write(self, rows: torch.Tensor, **new: torch.Tensor) -> None:
        """Writes new[name] [B, H, T, c] at the device row indices `rows` [T] (no host count changes)."""
        for name, value in new.items():
            self.tensors[name].index_copy_(2, rows, value)

    def unfix(self, length: int) -> None:
        """Fixed-shape decoding ended with rows [0, length) written."""
        self.fixed_rows, self.length = None, length

    def nbytes(self) -> dict[str, int]:
        return {name: t.numel() * t.element_size() for name, t in self.tensors.items()}

    def row(self, index: int) -> RowBuffers:
        """Views of one sequence's rows (batch row `index`), as a [1, ...] _Buffers of the same length."""
        view = copy.copy(self)
        view.tensors = {name: t[index : index + 1] for name, t in self.tensors.items()}
        return view
