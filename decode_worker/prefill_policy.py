"""Conditional disaggregation: when a prompt's uncached part is short, a round trip to a
prefill worker costs more than computing it here (the follow-up turn of a warm session)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillDecision:
    remote: bool
    reason: str


def decide_prefill(prompt_tokens: int, cached_tokens: int, has_prefill_endpoint: bool,
                   max_local_tokens: int, max_local_fraction: float) -> PrefillDecision:
    if not has_prefill_endpoint:
        return PrefillDecision(False, "no_prefill_endpoint")
    uncached = prompt_tokens - cached_tokens
    if uncached > max_local_tokens:
        return PrefillDecision(True, "uncached_tokens_above_threshold")
    if uncached > max_local_fraction * prompt_tokens:
        return PrefillDecision(True, "uncached_fraction_above_threshold")
    return PrefillDecision(False, "short_uncached_suffix")
