"""Rotary position embedding variants, read from a config and turned into frequencies.

Both `config.json` layouts are read: the legacy one (`rope_theta` beside an optional
`rope_scaling` dict) and the one current `transformers` writes (`rope_parameters`, flat or
nested per layer type). A rope type or field this module does not implement is refused by
name: a silently defaulted rope gives fluent but wrong tokens. The frequency formulas follow
`transformers`' `modeling_rope_utils` step for step, in float32 as it computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from common.errors import ModelLoadError
from engine.model.kernels import kernels, norm_rope_kernels

KINDS = ("default", "linear", "llama3", "yarn")
# Every key a rope dict may carry; each is honoured by the kinds that use it.
_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "partial_rotary_factor", "original_max_position_embeddings",
    "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
    "mscale_all_dim", "truncate",
}


@dataclass(frozen=True)
class RopeSpec:
    kind: str
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn: scales cos and sin, i.e. q·k by its square
    truncate: bool = True  # yarn

    def inv_freq(self, dim: int) -> torch.Tensor:
        """[dim/2] float32 inverse frequencies."""
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
            old = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        if self.kind == "yarn":
            return _yarn_inv_freq(self, dim)
        return inv


def _yarn_inv_freq(spec: RopeSpec, dim: int) -> torch.Tensor:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp linearly in between."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(spec.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (spec.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def read_rope(params: dict[str, Any], max_position_embeddings: int, source: str, where: str) -> RopeSpec:
    """One rope dict (already merged with a legacy `rope_theta`) → RopeSpec, or a ModelLoadError naming
    `where` (e.g. `rope_parameters.full_attention`) and the offending field."""
    unknown = sorted(set(params) - _KEYS)
    if unknown:
        raise ModelLoadError(f"{source}: {where} has fields splitfire does not implement: {unknown}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in KINDS:
        raise ModelLoadError(f"{source}: {where}.rope_type {kind!r} is not supported (supported: {list(KINDS)})")
    partial = params.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(f"{source}: {where}.partial_rotary_factor={partial} (partial rotary) is not supported")
    if params.get("rope_theta") is None:
        raise ModelLoadError(f"{source}: {where} has no rope_theta")

    def need(name: str) -> Any:
        if params.get(name) is None:
            raise ModelLoadError(f"{source}: {where}.{name} is required for rope_type {kind!r}")
        return params[name]

    theta = float(params["rope_theta"])
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    if kind == "default":
        return RopeSpec("default", theta)
    if kind == "linear":
        return RopeSpec("linear", theta, factor=float(need("factor")))
    if kind == "llama3":
        return RopeSpec("llama3", theta, factor=float(need("factor")), original_max_position_embeddings=original,
                        low_freq_factor=float(need("low_freq_factor")), high_freq_factor=float(need("high_freq_factor")))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    return RopeSpec("yarn", theta, factor=factor, original_max_position_embeddings=original,
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    attention_factor=float(attention), truncate=bool(params.get("truncate", True)))


def rope_cache(spec: RopeSpec, head_dim: int, max_positions: int, device: torch.device) -> torch.Tensor:
    """[positions, head_dim/2] complex64: (cos + i sin) * attention_factor for every position."""
    inv = spec.inv_freq(head_dim).to(device)
    angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv)
    return torch.polar(torch.full_like(angles, spec.attention_factor), angles)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, dim] with interleaved pairs; freqs: [T, 1, dim/2] complex (cos + i sin). One Triton launch
    where the kernels run (`triton_ops.rope`: CUDA by default), else `plain_rope`."""
    ops = kernels("triton_ops", x.device.type)
    if ops is not None and norm_rope_kernels() and x.dim() == 3 and x.stride(-1) == 1 \
            and freqs.dtype == torch.complex64:
        return ops.rope(x, freqs)
    return plain_rope(x, freqs)


def plain_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in torch's ops: a float32 complex multiply (3-4 launches on a GPU)."""
    t, h, d = x.shape
    xc = torch.view_as_complex(x.float().reshape(t, h, d // 2, 2))
    return torch.view_as_real(xc * freqs).reshape(t, h, d).to(x.dtype)
