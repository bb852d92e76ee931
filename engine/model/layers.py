"""The building blocks every model family shares: linear, RMSNorm, gated MLP, activations."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ModelLoadError
from engine.model import quant
from engine.model.compressed_weight import CompressedBF16
from engine.model.compressed_weight import linear as compressed_linear
from engine.model.kernels import cpu_ops, kernels, norm_rope_kernels
from engine.model.lora import LoRAWeights
from engine.model.parallel import ONE, Shard

log = logging.getLogger("splitfire.engine")


@cache
def cpu_packing_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pre-pack linear weights of `dtype` on this CPU.

    bfloat16 packing needs AVX512-BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU oneDNN raises
    at pack time. Probed once with a tiny weight, so a missing feature means the plain (MKL)
    path, named in the log, instead of a crash at load.
    """
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        w = pack_weight(torch.ones(8, 8, dtype=dtype))
        cpu_linear(torch.ones(2, 8, dtype=dtype), w)
    except RuntimeError as e:
        log.info("oneDNN weight packing off for %s on this CPU (capability %s): %s", dtype,
                 torch.backends.cpu.get_cpu_capability(), str(e).splitlines()[0])
        return False
    return True


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)


def cpu_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class WeightFormat:
    """How a `Linear` multiplies: chosen once, when its weight is loaded (the subclasses below), reading the
    layer's tensors of that format."""

    name = ""

    def __init__(self, lin: Linear):
        self.lin = lin

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class PlainWeight(WeightFormat):
    """The weight as a float tensor (`F.linear`)."""

    name = "plain"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.lin.weight, bias)


class PackedWeight(WeightFormat):
    """The weight pre-packed for oneDNN on CPU (`pack_weight`)."""

    name = "packed"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.lin.packed is not None
        return cpu_linear(x, self.lin.packed, bias)


class QuantizedWeights(WeightFormat):
    """int8, int4 or fp8 row blocks (`quant.linear`: C kernels on CPU, Triton on the GPU)."""

    name = "quantized"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.lin.quantized is not None
        return quant.linear(x, self.lin.quantized, bias, self.lin.int8_activations)


class CompressedWeight(WeightFormat):
    """A losslessly compressed bfloat16 weight, decoded per tile (`compressed_weight.linear`)."""

    name = "compressed"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.lin.compressed is not None
        return compressed_linear(x, self.lin.compressed, bias)


class Linear(nn.Module):
    """`nn.Linear` whose weight format is chosen once, when it is loaded (`format`: plain, oneDNN-packed on
    CPU, quantized int8/int4/fp8, or losslessly compressed), with LoRA deltas and the tensor-parallel sum
    around whichever it is.

    oneDNN packing, measured on this project's 2-core EPYC (fp32, weights streamed from DRAM, per matmul):
    gate_up at 1/4/32 rows 626/849/1367 us with `F.linear` (MKL) vs 350/323/685 us packed;
    lm_head 10.6/17.5/32.4 ms vs 5.3/5.8/11.3 ms; 512-row prefill 152 vs 206 GFLOP/s.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        # Weight-only quantized: row blocks (one, or one per format when a checkpoint mixes them).
        self.quantized: list[quant.QuantizedWeight] | None = None
        self.compressed: CompressedBF16 | None = None  # `--compress-weights` (engine/model/compressed_weight.py)
        self.int8_activations = False  # see quant.linear; set for the whole model by the engine
        # Row-parallel (tensor parallel): this rank multiplies its slice of the input; the partial
        # outputs are summed over the ranks (the bias, on rank 0 only, is added once).
        self.reduce: Shard | None = None
        self.lora: LoRAWeights | None = None  # resident LoRA adapters' factors (`lora.py`), when enabled
        self.format: WeightFormat = PlainWeight(self)

    def pack_for_cpu(self, keep_original: bool = False) -> None:
        if self.quantized is not None:
            return
        self.packed = pack_weight(self.weight)
        self.format = PackedWeight(self)
        if not keep_original:
            self.weight = None  # type: ignore[assignment]

    def set_quantized(self, parts: list[quant.QuantizedWeight]) -> None:
        n = sum(p.shape[0] for p in parts)
        k = {p.shape[1] for p in parts}
        expected = (self.weight.shape[0], self.weight.shape[1])
        if (n, *k) != expected:
            raise ModelLoadError(f"quantized weight of shape ({n}, {sorted(k)}) for a linear layer of {expected}")
        device = self.weight.device
        parts = [p.to(device) for p in parts]
        merged = quant.concat_rows(parts) if len(parts) > 1 else parts[0]
        self.quantized = [merged] if merged is not None else parts
        self.format = QuantizedWeights(self)
        self.weight = None  # type: ignore[assignment]

    def set_compressed(self, w: CompressedBF16) -> None:
        """Multiply by `w` (this layer's weight, losslessly compressed); the bfloat16 weight is freed."""
        if w.shape != (self.out_features, self.in_features):
            raise ModelLoadError(f"compressed weight of shape {w.shape} for a linear layer of "
                                 f"{(self.out_features, self.in_features)}")
        self.compressed = w
        self.format = CompressedWeight(self)
        self.weight = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.format(x, self.bias)
        if self.lora is not None:
            out = self.lora.add_deltas(x, out)
        return out if self.reduce is None else self.reduce.all_reduce(out)


class RMSNorm(nn.Module):
    """RMSNorm in the two orders checkpoints were trained with.

    Llama order: normalise in float32, cast, then scale by w in the model dtype. Gemma order:
    normalise and scale by (1 + w) in float32, then cast; `load` stores (1 + w) in float32 once.
    """

    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def load(self, w: torch.Tensor, name: str) -> None:
        if tuple(w.shape) != tuple(self.weight.shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(w.shape)}, config implies {tuple(self.weight.shape)}")
        if self.gemma:
            self.weight = nn.Parameter((1.0 + w.float()).to(self.weight.device), requires_grad=False)
        else:
            self.weight.copy_(w)

    def _fused(self, x: torch.Tensor) -> bool:
        """float32 on CPU with the C kernels: one pass (`cpu_ops.add_rmsnorm`). Both orders are the
        same arithmetic in float32 (Gemma's weight already holds 1 + w)."""
        return (x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu"
                and x.dim() == 2 and x.is_contiguous() and cpu_ops.small(x.shape[0]))

    def _triton(self, *xs: torch.Tensor) -> ModuleType | None:
        """The Triton kernels (`triton_ops.rms_norm`: the residual add and the norm in one launch, where the plain
        path takes up to nine) when they run on these rows' device (`kernels`: CUDA by default), for rows of
        one dtype laid out with unit column stride."""
        ops = kernels("triton_ops", xs[0].device.type)
        if ops is None or not norm_rope_kernels():
            return None
        ok = all(x.dim() == 2 and x.stride(-1) == 1 and x.dtype == xs[0].dtype for x in xs)
        return ops if ok and xs[0].shape[-1] <= 32768 else None

    def add_forward(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + h), residual + h): the pre-norm block's residual add fused with the next
        norm. `residual` may be updated in place."""
        if self._fused(residual) and h.dtype == torch.float32 and h.is_contiguous():
            return cpu_ops.add_rmsnorm(residual, h, self.weight, self.eps), residual
        ops = self._triton(h, residual)
        if ops is not None:
            return ops.rms_norm(h, self.weight, self.eps, residual, weight_after_cast=not self.gemma), residual
        return self.plain_add_forward(h, residual)

    def plain_add_forward(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_forward` in torch's own ops (the reference the fused kernels are held to)."""
        residual = residual + h
        return self.plain(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return cpu_ops.add_rmsnorm(x, None, self.weight, self.eps)
        ops = self._triton(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps, weight_after_cast=not self.gemma)
        return self.plain(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The norm in torch's own ops."""
        shape = (x.shape[-1],)
        if self.gemma:
            return F.rms_norm(x.float(), shape, self.weight, self.eps).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}")


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one matmul. Tensor parallel: this
    rank's slice of the intermediate size (`columns`), down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False, shard: Shard = ONE,
                 reduce: bool = True):
        """`reduce` False: a row-parallel down's partial output is left for the caller to sum (a MoE's
        shared expert, summed with the routed experts' part in one all-reduce)."""
        super().__init__()
        self.columns = shard.even(intermediate, "the MLP's intermediate size")
        local = len(self.columns)
        self.gate_up = Linear(hidden, 2 * local, bias=bias)
        self.down = Linear(local, hidden, bias=bias and shard.rank == 0)
        if shard.parallel and reduce:
            self.down.reduce = shard
        self.act = activation(act)
        self.silu = act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        if self.silu and gu.dtype == torch.float32 and gu.device.type == "cpu" and cpu_ops.small(gu.shape[0]):
            return self.down(cpu_ops.silu_mul(gu.contiguous()))
        gate, up = gu.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)
