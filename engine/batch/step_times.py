"""Host time an engine step spends in each phase, summed over steps: what `loadtest/bench_host.py`
reports. Off (None on the engine and runner) unless a benchmark turns it on; on, it costs a clock
read per phase boundary and two per token for detokenization."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class StepTimes:
    steps: int = 0
    tokens: int = 0  # tokens committed (the per-token denominators)
    schedule: float = 0.0  # Scheduler.schedule: which sequences run, blocks for them, drafts
    prepare: float = 0.0  # the batch as tensors (ids, positions, block tables, attention metadata)
    forward: float = 0.0  # the model (on a GPU: launching it; on a CPU: computing it)
    sample: float = 0.0  # logits to tokens, reading them back
    commit: float = 0.0  # counting tokens computed, stop checks, outputs (detokenization excluded)
    detokenize: float = 0.0  # token ids to text deltas, stop strings

    PHASES = ("schedule", "prepare", "forward", "sample", "commit", "detokenize")

    def per_step_ms(self) -> dict[str, float]:
        return {p: getattr(self, p) * 1e3 / max(self.steps, 1) for p in self.PHASES}

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
