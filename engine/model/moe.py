"""Mixture-of-experts MLP: a router picks each token's top-k experts; each expert is a gated MLP.

Expert compute is grouped so a step costs what its *active* experts cost: the step's
(token, expert) pairs are sorted by expert, and every expert some token chose runs one matmul
over all of its tokens, in expert order (the order `transformers` adds them in). Experts no
token chose are never touched. On CUDA a Triton grouped-GEMM kernel (`kernels/moe_triton.py`)
does the same behind this seam, for float and for quantized experts (stacked per projection,
dequantized in registers); `grouped_experts_reference` is what both are held equal to.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ModelLoadError
from engine.model import compressed_weight, quant
from engine.model.kernels import kernels
from engine.model.layers import MLP, Linear, activation, cpu_linear, pack_weight
from engine.model.lora import ExpertLoRA
from engine.model.model_config import ModelConfig
from engine.model.parallel import ONE, Shard


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, keep the top k, optionally rescale them to sum to 1.
    Returns (weights [T, k] float32, expert ids [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, num_groups: int, topk_groups: int,
                  renormalize: bool, scale: float, scoring: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing. V3 ("noaux_tc"): sigmoid scores; the load-balancing `bias` is added only to
    choose experts: first the `topk_groups` groups whose best two biased scores sum highest, then the
    top k experts inside them. V2 (`bias` None, softmax scores): groups ranked by their best expert
    ("group_limited_greedy"; one group = plain top-k). The chosen experts are weighted by their
    *unbiased* scores (renormalised to sum to 1 if asked), times `scale`. Float32 throughout."""
    scores = torch.sigmoid(logits.float()) if scoring == "sigmoid" else torch.softmax(logits.float(), dim=-1)
    biased = scores + bias.float() if bias is not None else scores
    if num_groups > 1:
        t, e = biased.shape
        grouped = biased.view(t, num_groups, e // num_groups)
        group_scores = (grouped.topk(2, dim=-1).values.sum(dim=-1) if bias is not None
                        else grouped.amax(dim=-1))
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
    ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Order of the flattened (token, choice) pairs grouped by expert, and each expert's count. An id of
    `num_experts` (expert parallel: another rank's expert) sorts last, into a count of its own."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1).tolist()  # the step's one host sync
    return order, counts


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                    gate_up: ExpertFn, down: ExpertFn, act: Callable[[torch.Tensor], torch.Tensor],
                    lora: ExpertLoRA | None = None, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, one matmul pair per active expert.

    `gate_up(e, rows)` / `down(e, rows)` apply expert e's projections (plain or pre-packed weights);
    `lora` with `lora_slots` (each token's adapter slot): the adapters' expert deltas added to both.
    """
    k = ids.shape[1]
    order, counts = sort_by_expert(ids, num_experts)
    order = order[: len(order) - counts[num_experts]]  # (pairs of experts another rank holds: not here)
    token_of = order // k
    rows = x.index_select(0, token_of)
    w = weights.flatten().index_select(0, order).unsqueeze(1).to(x.dtype)
    out_rows = torch.empty_like(rows)
    slots = lora_slots.index_select(0, token_of) if lora is not None and lora_slots is not None else None
    start = 0
    for e, n in enumerate(counts[:num_experts]):
        if n == 0:
            continue
        x_e = rows[start : start + n]
        gu = gate_up(e, x_e)
        if slots is not None and lora is not None and lora.gate_up is not None:
            lora.add(gu, x_e, slots[start : start + n], e, lora.gate_up)
        gate, up = gu.chunk(2, dim=-1)
        # down is linear: scaling its input by the routing weight is the same as scaling its
        # output, on intermediate-size rows (4x fewer than hidden-size ones in Qwen3-MoE).
        h = act(gate).mul_(up).mul_(w[start : start + n])
        d = down(e, h)
        if slots is not None and lora is not None and lora.down is not None:
            lora.add(d, h, slots[start : start + n], e, lora.down)
        out_rows[start : start + n] = d
        start += n
    return torch.zeros_like(x).index_add_(0, token_of, out_rows)


def grouped_experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                              w_down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The readable path: stacked weights [E, 2I, H] and [E, H, I], plain matmuls."""
    return grouped_experts(x, ids, weights, w_gate_up.shape[0], lambda e, r: F.linear(r, w_gate_up[e]),
                           lambda e, r: F.linear(r, w_down[e]), act)


class Experts(nn.Module):
    """Every expert's weights stacked: gate and up fused [E, 2I, H], down [E, H, I] — or, quantized,
    one `QuantizedWeight` per expert and projection (experts are most of an MoE model's bytes)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.act = activation(act)
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.quantized: tuple[list[quant.QuantizedWeight], list[quant.QuantizedWeight]] | None = None
        # The same quantized experts stacked per projection, where the grouped GPU kernel runs them.
        self.stacked: tuple[quant.QuantizedStack, quant.QuantizedStack] | None = None
        # `--compress-weights`: each projection's stack held compressed as rows ([E * 2I, H], [E * H, I]).
        self.compressed: tuple[compressed_weight.CompressedBF16, compressed_weight.CompressedBF16] | None = None
        # Expert parallel: some tokens' choices are another rank's experts (the grouped torch path skips
        # them; the Triton kernel does not know them yet, so it is not used).
        self.partial = False
        self.lora: ExpertLoRA | None = None  # resident adapters' expert factors (`lora.py`), when enabled

    def set_quantized(self, gate_up: list[quant.QuantizedWeight], down: list[quant.QuantizedWeight]) -> None:
        """Run from quantized experts; the stacked float weights are freed."""
        e, two_i, h = self.gate_up.shape
        for i, (gu, dn) in enumerate(zip(gate_up, down, strict=True)):
            if gu.shape != (two_i, h) or dn.shape != (h, two_i // 2):
                raise ModelLoadError(f"quantized expert {i}: gate/up {gu.shape}, down {dn.shape}; the config "
                                     f"implies {(two_i, h)} and {(h, two_i // 2)}")
        if len(gate_up) != e:
            raise ModelLoadError(f"{len(gate_up)} quantized experts for {e}")
        device = self.gate_up.device
        gate_up, down = [w.to(device) for w in gate_up], [w.to(device) for w in down]
        if kernels("moe_triton", device.type) is not None:
            # The grouped kernel picks each tile's expert on the device: one stack per projection
            # (the per-expert weights become views of it, so nothing is held twice).
            stacks = quant.QuantizedStack.of(gate_up), quant.QuantizedStack.of(down)
            if stacks[0] is not None and stacks[1] is not None:
                self.stacked = (stacks[0], stacks[1])
                gate_up, down = stacks[0].parts(), stacks[1].parts()
        self.quantized = (gate_up, down)
        self.gate_up = self.down = None  # type: ignore[assignment]

    def quantize(self, kind: str) -> None:
        """`--quantization` on float experts: each expert's projections round-to-nearest, as `Linear`s are."""
        if self.quantized is not None or self.gate_up is None:
            return
        group = quant.group_size_for
        self.set_quantized([quant.quantize(w, kind, group(w.shape[1], kind)) for w in self.gate_up],
                           [quant.quantize(w, kind, group(w.shape[1], kind)) for w in self.down])

    def compress(self) -> int:
        """`--compress-weights`: both bfloat16 stacks packed (`compressed_weight.pack`, each as the rows of
        one matrix) and freed. Returns the bytes saved (0 if there is nothing to compress)."""
        if self.gate_up is None or self.gate_up.dtype != torch.bfloat16 or not self.gate_up.numel():
            return 0
        saved = 0
        packed = []
        for w in (self.gate_up, self.down):
            c = compressed_weight.pack(w.reshape(-1, w.shape[2]))
            saved += w.numel() * w.element_size() - c.nbytes
            packed.append(c)
        self.compressed = (packed[0], packed[1])
        self.gate_up = self.down = None  # type: ignore[assignment]
        return saved

    def pack_for_cpu(self) -> None:
        """oneDNN-packed copy of each expert (see `layers.Linear`); the stacked weights are dropped
        (unless the Triton kernel, which reads them, is forced on the CPU)."""
        if self.quantized is not None or kernels("moe_triton", "cpu") is not None:
            return
        self.packed = ([pack_weight(w) for w in self.gate_up], [pack_weight(w) for w in self.down])
        self.gate_up = self.down = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # A step with rows under adapters that adapt the experts takes the grouped loop, which adds them.
        slots = self.lora.step_slots() if self.lora is not None else None
        lora = self.lora if slots is not None else None
        fused = kernels("moe_triton", x.device.type) if not self.partial and lora is None else None
        if self.stacked is not None and fused is not None:
            return fused.fused_experts(x, ids, weights, *self.stacked, self.act)
        if self.compressed is not None:
            cgu, cdn = self.compressed
            if fused is not None:
                return fused.fused_experts(x, ids, weights, cgu, cdn, self.act, num_experts=self.num_experts)
            # (expert parallel, expert adapters, or no Triton: each chosen expert's rows decoded for its GEMM)
            n_gu, n_dn = cgu.shape[0] // self.num_experts, cdn.shape[0] // self.num_experts
            return grouped_experts(x, ids, weights, self.num_experts,
                                   lambda e, r: F.linear(r, compressed_weight.row_range(cgu, e * n_gu, n_gu).to(r.dtype)),
                                   lambda e, r: F.linear(r, compressed_weight.row_range(cdn, e * n_dn, n_dn).to(r.dtype)),
                                   self.act, lora, slots)
        if self.quantized is not None:
            gu, dn = self.quantized
            return grouped_experts(x, ids, weights, self.num_experts, lambda e, r: quant.linear(r, [gu[e]], None),
                                   lambda e, r: quant.linear(r, [dn[e]], None), self.act, lora, slots)
        if self.packed is not None:
            gu, dn = self.packed
            return grouped_experts(x, ids, weights, self.num_experts, lambda e, r: cpu_linear(r, gu[e]),
                                   lambda e, r: cpu_linear(r, dn[e]), self.act, lora, slots)
        if fused is not None:
            return fused.fused_experts(x, ids, weights, self.gate_up, self.down, self.act)
        w_gu, w_dn = self.gate_up, self.down
        return grouped_experts(x, ids, weights, self.num_experts, lambda e, r: F.linear(r, w_gu[e]),
                               lambda e, r: F.linear(r, w_dn[e]), self.act, lora, slots)


class MoE(nn.Module):
    """Tensor parallel (every rank holds every token's hidden state): each rank computes its part —
    with expert parallel its `local` experts whole, else every expert's slice of the intermediate
    size (and of the shared experts') — and one all-reduce sums the parts. With expert parallel the
    dispatch is a rank keeping the (token, expert) pairs of its experts, and the combine is that
    all-reduce: an all-to-all would only pay off with data-parallel attention (tokens not replicated)."""

    def __init__(self, cfg: ModelConfig, shard: Shard = ONE, expert_parallel: bool = False):
        super().__init__()
        m = cfg.moe
        assert m is not None
        self.cfg = m
        self.shard = shard
        self.local = shard.even(m.num_experts, "the routed experts") if expert_parallel else range(m.num_experts)
        self.columns = range(m.intermediate_size) if expert_parallel else shard.even(
            m.intermediate_size, "the experts' intermediate size")
        self.router = Linear(cfg.hidden_size, m.num_experts)
        if m.grouped:
            self.router.float()  # scored in float32 whatever the model dtype, as the reference does
        # DeepSeek-V3's expert-choice bias, kept in float32 (the checkpoint's dtype for it).
        self.score_bias = (nn.Parameter(torch.zeros(m.num_experts, dtype=torch.float32), requires_grad=False)
                           if m.scoring == "sigmoid" else None)
        self.experts = Experts(len(self.local), cfg.hidden_size, len(self.columns), cfg.activation)
        self.experts.partial = expert_parallel and shard.parallel
        # (The shared expert's down is not reduced on its own: the MoE's one all-reduce sums it too.)
        self.shared = (MLP(cfg.hidden_size, m.shared_intermediate_size, cfg.activation, shard=shard, reduce=False)
                       if m.shared_intermediate_size else None)
        self.shared_gate = Linear(cfg.hidden_size, 1) if m.shared_intermediate_size and m.shared_gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.cfg
        if m.grouped:
            weights, ids = route_grouped(self.router(x.float()), self.score_bias, m.top_k, m.num_groups, m.topk_groups,
                                         m.renormalize, m.routed_scale, m.scoring)
        else:
            weights, ids = route(self.router(x), m.top_k, m.renormalize)
        if len(self.local) < m.num_experts:  # expert parallel: another rank's experts sort past this rank's
            first, n = self.local.start, len(self.local)
            ids = torch.where((ids >= first) & (ids < first + n), ids - first, torch.full_like(ids, n))
        # Routing weights are applied in the activations' dtype (Qwen's order; Mixtral's transformers
        # code multiplies in float32: the difference is within bfloat16's own rounding).
        out = self.experts(x, ids, weights.to(x.dtype))
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (torch.sigmoid(self.shared_gate(x)) * shared if self.shared_gate is not None else shared)
        return self.shard.all_reduce(out) if self.shard.parallel else out
