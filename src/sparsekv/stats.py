"""BudgetStats: the tokens each sparse layer's decode steps kept and saw, per selection row; what
`SparseCache.stats` reports (and sums over the ranks of a tensor-parallel model)."""

from __future__ import annotations

import torch

from sparsekv.step import Selection


def _visible_rows(visible: torch.Tensor, heads: int) -> torch.Tensor:
    """visible [B, Q, N] -> the visible count of every selection row [B * heads * Q], in `Selection` order."""
    return visible.sum(-1)[:, None].expand(-1, heads, -1).flatten()


class BudgetStats:
    """Tokens attended per (query, selection head) row of the sparse layers' decode steps.

    On CPU every record lands in `kept_counts` / `visible_counts` at once. Device records stay on the device
    until the counts are read (no host sync inside the decode step, so a step can be captured in a CUDA graph).
    Fixed-shape steps (a CUDA graph replays them without running Python) add to per-layer sums on the device
    instead: `summary` covers both kinds of record, `layer_counts` only the per-row ones.

    Under tensor parallelism (`shards` > 1) each rank records its own heads' rows; `layer_sums` and `summary` add
    up every rank's (a collective: every rank of the process group must call them).
    """

    def __init__(self, num_layers: int, shards: int = 1) -> None:
        self.num_layers = num_layers
        self.shards = shards
        self._kept: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._seen: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        #: [layers, 4] float64 on the device: sum of kept, sum of visible, sum of kept / visible, rows
        self._sums: torch.Tensor | None = None
        self._host_sums = torch.zeros(num_layers, 4, dtype=torch.float64)  # `add_host`, same columns

    def record(self, layer_idx: int, selection: Selection, visible: torch.Tensor) -> None:
        """selection counts [B, S, Q]; visible [B, Q, N]."""
        self._append_counts(layer_idx, selection.counts().flatten(), _visible_rows(visible, selection.indices.shape[1]))

    def record_all_visible(self, layer_idx: int, visible: torch.Tensor, heads: int) -> None:
        """`record` for a step whose rows attended every visible token (the dense fallback); visible [B, Q, N]."""
        seen = _visible_rows(visible, heads)
        self._append_counts(layer_idx, seen, seen)

    def _append_counts(self, layer_idx: int, kept: torch.Tensor, seen: torch.Tensor) -> None:
        """Per-row (kept, visible) counts of one eager step: kept on the CPU at once, device ones read later (the
        step itself never syncs)."""
        kept, seen = kept.to(torch.int32), seen.to(torch.int32)
        if kept.device.type == "cpu":
            self._kept[layer_idx].append(kept)
            self._seen[layer_idx].append(seen)
        else:
            self._pending.append((layer_idx, kept, seen))

    def prepare_sums(self, device: torch.device) -> None:
        """Allocates the device sums (outside any CUDA graph capture, so every replay adds to the same tensor)."""
        if self._sums is None or self._sums.device != device:
            self._sums = torch.zeros(self.num_layers, 4, dtype=torch.float64, device=device)

    def add_sums(self, layer_idx: int, sums: torch.Tensor) -> None:
        """`record` for fixed-shape steps, in place on the device sums: one step's [4] sums of a layer
        (`step_sums` or `row_sums`)."""
        self._sums[layer_idx].add_(sums)

    @staticmethod
    def step_sums(selection: Selection, per_kept: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
        """A fixed-shape step's [4] sums: its kept tokens summed over its rows, times `per_kept` ([1, 0,
        1 / visible, 0]: every row of such a step sees the same tokens), plus `fixed` ([0, visible x rows, 0,
        rows]); both are built once per step (`fixed_step_stats`)."""
        return torch.addcmul(fixed, per_kept, selection.valid.sum(dtype=torch.float64))

    @staticmethod
    def row_sums(selection: Selection, weights: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
        """`step_sums` for a fixed-shape step whose rows see slots of their own (lossless rounds: a row's masked
        draft slots are not among its visible ones): its kept tokens per row through `weights` [4, rows], plus
        `fixed`; both are built once per step (`row_step_stats`)."""
        return torch.addmv(fixed, weights, selection.valid.sum(-1, dtype=torch.float64).flatten())

    @staticmethod
    def row_step_stats(visible: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`row_sums`'s two tensors for a step whose rows see visible [B, Q, N] with `heads` selection heads:
        weights [4, rows] (per row: 1, 0, 1 / visible, 0) and fixed ([0, visible summed over the rows, 0, rows])."""
        seen = _visible_rows(visible, heads).double()
        zero = seen.new_zeros(())
        weights = torch.stack([torch.ones_like(seen), torch.zeros_like(seen), 1 / seen.clamp(min=1),
                               torch.zeros_like(seen)])  # fmt: skip
        return weights, torch.stack([zero, seen.sum(), zero, zero + len(seen)])

    def add_host(self, layer_idx: int, *, kept: float, seen: float, fraction: float, rows: int) -> None:
        """Sums known on the host (kept, visible, kept / visible over rows, rows) added to a layer's."""
        self._host_sums[layer_idx] += torch.tensor([kept, seen, fraction, rows], dtype=torch.float64)

    @staticmethod
    def fixed_step_stats(seen: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`step_sums`'s two vectors for a step whose every row sees `seen` tokens (a [1] tensor)."""
        seen = seen.double().view(1)
        zero = torch.zeros_like(seen)
        per_kept = torch.cat([zero + 1, zero, 1 / seen.clamp(min=1), zero])
        fixed = torch.cat([zero, seen * rows, zero, zero + rows])
        return per_kept, fixed

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for layer_idx, kept, seen in pending:
            self._kept[layer_idx].append(kept.to("cpu"))
            self._seen[layer_idx].append(seen.to("cpu"))

    @property
    def kept_counts(self) -> list[list[torch.Tensor]]:
        self._flush()
        return self._kept

    @property
    def visible_counts(self) -> list[list[torch.Tensor]]:
        self._flush()
        return self._seen

    def layer_counts(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept, visible) per recorded row of one layer, as flat int tensors."""
        kept, seen = self.kept_counts[layer_idx], self.visible_counts[layer_idx]
        if not kept:
            return torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
        return torch.cat(kept), torch.cat(seen)

    def layer_sums(self) -> torch.Tensor:
        """[layers, 4] float64 on the CPU: kept, visible, kept / visible summed over every record, and rows."""
        sums = self._host_sums.clone()
        if self._sums is not None:
            sums += self._sums.cpu()
        for i in range(self.num_layers):
            kept, seen = (t.double() for t in self.layer_counts(i))
            sums[i] += torch.stack([kept.sum(), seen.sum(), (kept / seen.clamp(min=1)).sum(), torch.tensor(kept.numel())])
        if self.shards > 1 and torch.distributed.is_initialized():
            sums = _sum_over_ranks(sums)
        return sums

    def summary(self) -> dict:
        """Mean tokens attended per query row and selection head over the sparse layers' decode steps."""
        sums = self.layer_sums()
        rows = sums[:, 3]
        if not bool((rows > 0).any()):
            return {
                "avg_budget_tokens": None,
                "avg_context_tokens": None,
                "avg_budget_fraction": None,
                "per_layer_avg_tokens": {},
            }
        total = sums.sum(0)
        return {
            "avg_budget_tokens": float(total[0] / total[3]),
            "avg_context_tokens": float(total[1] / total[3]),
            "avg_budget_fraction": float(total[2] / total[3]),
            "per_layer_avg_tokens": {i: float(sums[i, 0] / rows[i]) for i in range(self.num_layers) if rows[i] > 0},
        }


def _sum_over_ranks(sums: torch.Tensor) -> torch.Tensor:
    """`sums` added up over the process group's ranks (on the rank's GPU where the backend is NCCL)."""
    nccl = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else sums.device
    total = sums.to(device)
    torch.distributed.all_reduce(total)
    return total.cpu()
