"""Per-request sampling settings, validated once where the request enters the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import RequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n = the chosen token plus n alternatives
    grammar: str | None = None  # llguidance grammar text (common/grammar.py builds it); None = unconstrained
    # The prompt's last `resumed_tokens` tokens are this request's own earlier output (a failover
    # resuming elsewhere): the grammar, the seeded noise and the penalties continue from them.
    resumed_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # no EOS / stop token ids before this many output tokens
    # With a union grammar `free text | X` (the generic tool format): once the output's first
    # non-whitespace character is not one of these (X's openers), the grammar is dropped: its free-text
    # branch constrains nothing more, and masking every token would cost ~3-6% of decode for nothing.
    grammar_release: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Logits change per row before sampling (penalties, biases, min_tokens)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0)

    def validate(self) -> SamplingParams:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (0.0 < self.repetition_penalty <= 10.0, f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (len(self.stop) <= 16, "at most 16 stop strings"),
            (self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2^63), got {self.seed}"),
            (self.resumed_tokens >= 0, f"resumed_tokens must be >= 0, got {self.resumed_tokens}"),
            (all(-100.0 <= b <= 100.0 and t >= 0 for t, b in self.logit_bias.items()),
             "logit_bias maps token ids to values in [-100, 100]"),
            # (min_tokens counts the whole output; after a failover max_tokens is what is left of it)
            (0 <= self.min_tokens <= self.max_tokens + self.resumed_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise RequestError(msg)
        return self
