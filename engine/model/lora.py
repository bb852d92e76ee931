"""LoRA adapters applied to a mixed batch in one pass (punica / S-LoRA's idea, in torch).

A step's rows may belong to the base model or to any of the resident adapters. Each linear layer an
adapter targets holds every resident adapter's low-rank factors stacked by slot: A `[slots, R, in]`
and B `[slots, out, R]` (the scale folded into B, zero padding past an adapter's rank), so the
base matmul runs once for all rows and each adapter adds `(x A^T) B^T` to its own rows only.

A fused projection (q/k/v, gate/up) keeps its parts' factors side by side: A is the parts' A
matrices stacked (rank r each), B is block-diagonal — part p's B in its output rows and its own r
columns — so one pair of matmuls serves every part, and a part the adapter does not target is zero.

Three ways to add the deltas, held equal by a test: `segment_deltas`, the reference, walks the step's
runs of rows of one adapter (prompt chunks are one run each; decode rows interleave adapters);
`grouped_deltas` gathers all rows of each adapter present and does one pair of matmuls per adapter
(the grouped GEMM of punica's SGMV, with torch's index_select / index_add); `padded_deltas` puts every
adapter's rows in a zero-padded `[slots, rows, in]` block and runs two batched matmuls against all
slots' factors at once — a handful of ops per projection whatever the number of adapters, for steps
whose adapters have few rows each (decode). Measured on SmolLM2 at batch 16 over 8 adapters, the
grouped path's ~32 small ops per projection cost more than the matmuls themselves. On CUDA (or anywhere
with SPLITFIRE_KERNELS=triton) the deltas are punica's SGMV as two Triton kernels instead
(`kernels/lora_triton.py`: each run of rows cut into tiles of one adapter; two launches per projection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.kernels import kernels

PADDED_MAX_ROWS = 16  # an adapter with more rows in a step (a prompt chunk) takes the grouped path


@dataclass
class LoRARows:
    """Which rows of a step use which adapter slot."""

    segments: list[tuple[int, int, int]]  # (first row, end row, slot): runs of one adapter; base rows left out
    groups: list[tuple[int, torch.Tensor]]  # (slot, its rows): every adapter present, its rows gathered
    rows: torch.Tensor | None = None  # padded form: the adapter rows, grouped by slot
    padded: torch.Tensor | None = None  # ... and each one's place in the [slots * width] padded block
    width: int = 0  # rows per slot in the padded block (the most any adapter has); 0: no padded form
    slots: torch.Tensor | None = None  # every row's slot (-1: the base model), for the routed experts' deltas

    @staticmethod
    def build(row_slots: list[int], device: torch.device, max_width: int = PADDED_MAX_ROWS) -> LoRARows | None:
        """`row_slots`: each row's adapter slot, -1 for the base model. None when no row has one. The
        padded form is built when no adapter has more than `max_width` rows."""
        segments: list[tuple[int, int, int]] = []
        by_slot: dict[int, list[int]] = {}
        start = 0
        for i in range(1, len(row_slots) + 1):
            if i == len(row_slots) or row_slots[i] != row_slots[start]:
                slot = row_slots[start]
                if slot >= 0:
                    segments.append((start, i, slot))
                    by_slot.setdefault(slot, []).extend(range(start, i))
                start = i
        if not segments:
            return None
        groups = [(slot, torch.tensor(rows, dtype=torch.long, device=device)) for slot, rows in by_slot.items()]
        out = LoRARows(segments, groups, slots=torch.tensor(row_slots, dtype=torch.long, device=device))
        width = max(len(r) for r in by_slot.values())
        if width <= max_width:
            flat = [r for rows in by_slot.values() for r in rows]
            places = [slot * width + j for slot, rows in by_slot.items() for j in range(len(rows))]
            out.rows = torch.tensor(flat, dtype=torch.long, device=device)
            out.padded = torch.tensor(places, dtype=torch.long, device=device)
            out.width = width
        return out


class LoRAState:
    """The model's current step, shared by every layer that carries adapters (set per forward)."""

    def __init__(self, mode: str = "auto"):
        self.rows: LoRARows | None = None
        # auto: padded when the step has its form, else grouped; grouped; segments (the reference)
        self.mode = mode


def segment_deltas(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   segments: list[tuple[int, int, int]]) -> None:
    """The reference: for each run of rows of one adapter, out[rows] += (x[rows] A^T) B^T."""
    for start, end, slot in segments:
        out[start:end] += (x[start:end] @ a[slot].T) @ b[slot].T


def grouped_deltas(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   groups: list[tuple[int, torch.Tensor]]) -> None:
    """One pair of matmuls per adapter present, over all of its rows wherever they are in the step."""
    for slot, rows in groups:
        out.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T) @ b[slot].T)


def padded_deltas(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
                  padded: torch.Tensor, width: int) -> None:
    """Every adapter's rows in a zero-padded [slots, width, in] block; two batched matmuls against every
    slot's factors (an empty slot's rows are zeros), the real rows' results added back."""
    slots = a.shape[0]
    block = x.new_zeros(slots * width, x.shape[1])
    block.index_copy_(0, padded, x.index_select(0, rows))
    xa = torch.bmm(block.view(slots, width, -1), a.transpose(1, 2))
    d = torch.bmm(xa, b.transpose(1, 2)).view(slots * width, -1)
    out.index_add_(0, rows, d.index_select(0, padded))


class LoRAWeights:
    """One linear layer's factors for every slot, and its share of the step's deltas."""

    def __init__(self, state: LoRAState, slots: int, rank: int, in_features: int, out_features: int,
                 dtype: torch.dtype, device: torch.device, c_half: bool = False):
        """`rank`: the widest adapter this layer takes (the max rank times its fused parts); `c_half`: the
        fused CPU decode loop's copies (A and B transposed) in float16 instead of the model dtype."""
        self.state = state
        self.rank = rank
        self.a = torch.zeros(slots, rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, out_features, rank, dtype=dtype, device=device)
        # B transposed ([slots, rank, out]), kept beside it for the fused CPU decode loop's axpys along out
        # (`cpu_ops.c: sf_lora_rows`); on other devices only `b` is read.
        cpu = device.type == "cpu"
        c_dtype = torch.float16 if c_half else dtype
        self.bt = torch.zeros(slots, rank, out_features, dtype=c_dtype, device=device) if cpu else None
        self.a_c = (torch.zeros(slots, rank, in_features, dtype=torch.float16, device=device) if cpu and c_half
                    else self.a)  # (A as that loop reads it)
        self.held: set[int] = set()  # slots holding this layer's factors (an adapter may not target it)

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adapter factors for `slot`: A `[r, in]`, B `[out, r]` (scaled), r at most `rank`."""
        r = a.shape[0]
        if r > self.rank or a.shape[1] != self.a.shape[2] or b.shape != (self.b.shape[1], r):
            raise ValueError(f"LoRA factors A{tuple(a.shape)} B{tuple(b.shape)} do not fit a layer of "
                             f"{self.a.shape[2]} -> {self.b.shape[1]} with rank up to {self.rank}")
        self.clear(slot)
        self.a[slot, :r] = a.to(self.a.dtype)
        self.b[slot, :, :r] = b.to(self.b.dtype)
        if self.bt is not None:
            self.bt[slot, :r] = b.T.to(self.bt.dtype)
        if self.a_c is not self.a:
            self.a_c[slot, :r] = a.to(self.a_c.dtype)
        self.held.add(slot)

    def clear(self, slot: int) -> None:
        self.held.discard(slot)
        self.a[slot].zero_()
        self.b[slot].zero_()
        if self.bt is not None:
            self.bt[slot].zero_()
        if self.a_c is not self.a:
            self.a_c[slot].zero_()

    def add_deltas(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows = self.state.rows
        if rows is None:
            return out
        mode = self.state.mode
        sgmv = kernels("lora_triton", x.device.type) if mode == "auto" else None
        if sgmv is not None:
            sgmv.sgmv(x, out, self.a, self.b, rows.segments)
        elif mode == "auto" and rows.padded is not None and rows.rows is not None:
            padded_deltas(x, out, self.a, self.b, rows.rows, rows.padded, rows.width)
        elif mode in ("auto", "grouped"):
            grouped_deltas(x, out, self.a, self.b, rows.groups)
        else:
            segment_deltas(x, out, self.a, self.b, rows.segments)
        return out

    def row_groups(self, rows: slice) -> list[tuple[int, torch.Tensor]]:
        """For the step's `rows` (a slice of its rows): each slot holding this layer's factors that some of
        them run under, with their indices within the slice. Empty when no adapter row needs this layer."""
        step = self.state.rows
        if step is None or step.slots is None or not self.held:
            return []
        present = {s for a, b, s in step.segments if a < rows.stop and b > rows.start} & self.held
        if not present:
            return []
        slots = step.slots[rows]
        return [(s, (slots == s).nonzero().squeeze(1)) for s in sorted(present)]


@dataclass
class LoRATarget:
    """A LoRA target that is not a `Linear` layer (latent attention's kv_b, which the attention reads head by
    head instead of multiplying as a whole): its sizes, and its adapters' factors once enabled."""

    in_features: int
    out_features: int
    lora: LoRAWeights | None = None


class ExpertLoRA:
    """A mixture of experts' routed experts' factors for every slot (peft's LoRA on the stacked expert
    parameters: per expert e, A_e `[r, in]` and B_e `[out, r]`), allocated when the first adapter with any
    is placed (they are `slots x experts` pairs per layer). The deltas are added inside the grouped expert
    loop (`moe.grouped_experts`): for each expert, the rows of each adapter present get
    `(x A[slot, e]^T) B[slot, e]^T` on gate/up and on down."""

    def __init__(self, state: LoRAState, slots: int, max_rank: int, experts: int, hidden: int, inter: int,
                 dtype: torch.dtype, device: torch.device):
        self.state = state
        self.shape = (slots, experts, max_rank, hidden, inter)
        self.dtype, self.device = dtype, device
        self.gate_up: tuple[torch.Tensor, torch.Tensor] | None = None  # A [S, E, 2R, H], B [S, E, 2I, 2R]
        self.down: tuple[torch.Tensor, torch.Tensor] | None = None  # A [S, E, R, I], B [S, E, H, R]
        self.held: set[int] = set()  # slots holding expert factors

    def _allocate(self) -> None:
        if self.gate_up is None:
            s, e, r, h, i = self.shape
            z = dict(dtype=self.dtype, device=self.device)
            self.gate_up = (torch.zeros(s, e, 2 * r, h, **z), torch.zeros(s, e, 2 * i, 2 * r, **z))
            self.down = (torch.zeros(s, e, r, i, **z), torch.zeros(s, e, h, r, **z))

    def set(self, slot: int, factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """A slot's factors: gate/up A `[E, r2, H]`, B `[E, 2I, r2]`, down A `[E, r, I]`, B `[E, H, r]` (scaled)."""
        self._allocate()
        assert self.gate_up is not None and self.down is not None
        self.clear(slot)
        for (a_all, b_all), a, b in ((self.gate_up, *factors[:2]), (self.down, *factors[2:])):
            if a.shape[0] != a_all.shape[1] or a.shape[1] > a_all.shape[2] or a.shape[2] != a_all.shape[3] \
                    or b.shape[1] != b_all.shape[2]:
                raise ValueError(f"expert LoRA factors A{tuple(a.shape)} B{tuple(b.shape)} do not fit experts "
                                 f"A{tuple(a_all.shape[1:])} B{tuple(b_all.shape[1:])}")
            r = a.shape[1]
            a_all[slot, :, :r] = a.to(self.dtype)
            b_all[slot, :, :, :r] = b.to(self.dtype)
        self.held.add(slot)

    def clear(self, slot: int) -> None:
        self.held.discard(slot)
        for pair in (self.gate_up, self.down):
            if pair is not None:
                pair[0][slot].zero_()
                pair[1][slot].zero_()

    def step_slots(self) -> torch.Tensor | None:
        """This step's slot per row, when a row runs under an adapter with expert factors (else None)."""
        rows = self.state.rows
        if rows is None or rows.slots is None or not self.held or not any(s in self.held for _, _, s in rows.segments):
            return None
        return rows.slots

    @staticmethod
    def add(out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, e: int,
            factors: tuple[torch.Tensor, torch.Tensor]) -> None:
        """out[rows of slot s] += (x[rows] A[s, e]^T) B[s, e]^T for every slot s among `slots` (-1: none)."""
        a, b = factors
        for s in slots.unique().tolist():
            if s < 0:
                continue
            rows = (slots == s).nonzero().squeeze(1)
            out.index_add_(0, rows, (x.index_select(0, rows) @ a[s, e].T) @ b[s, e].T)
