"""How many prefill and decode workers the next interval needs: the planner's decision, from a
per-worker capacity profile, a load prediction and the SLOs actually observed.

Prefill and decode load move apart (long prompts want prefill workers; long answers and many
concurrent streams want decode workers), so each role is sized on its own:

- **prefill**: prompt tokens to compute per second (request rate x mean prompt x (1 - prefix hit
  ratio)) over what one prefill worker computes while meeting the TTFT SLO (`Profile.prefill_tps`),
  at `target_utilization` (queueing makes TTFT climb well before a worker is 100% busy);
- **decode**: concurrent streams by Little's law (rate x mean output tokens x the inter-token time
  at the SLO) over the largest batch one decode worker runs within the ITL SLO
  (`Profile.decode_batch_within`).

The load is predicted as the larger of the latest interval's and an exponentially weighted average
of the past (`alpha`): a rise is answered at once, a dip is not believed until it lasts — the
Mooncake conversation trace arrives in bursts of seconds, and scaling down into a burst costs TTFT.
Feedback corrects the model: a role whose observed p90 misses its SLO although the model says it has
enough gets one more worker, and the planner remembers it — the role's load is scaled by a learned
correction (what the profile overestimates of a worker in this fleet: prefix hits that do not
materialize, bursts within the interval) until the SLO is met with fewer, so the next interval does not
drain the worker it just had to add. The correction is learned only from an interval after which the role
was not just scaled up (the new workers' start and the backlog they inherit are not a capacity error),
and it decays slowly (`correction_decay` per interval in which the SLO is met) so one burst does not
keep workers for good. Scaling up is immediate; scaling down waits `down_after` intervals of
wanting fewer — the load fitting fewer workers at `down_margin` of the target utilization, so a load at
a whole number of workers does not add and drain one in turn — and then drains one worker per
interval; both stay within the role's `[min, max]`.

What it has learned (the corrections, the load average, the last means) outlives the process:
`learned()` / `resume()`, kept in a state file by `planner/state.py` (`--state`), so a restarted planner
does not relearn its fleet's corrections from SLO misses — and refused if learned against other SLOs
or another profile, whose errors the corrections measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Profile:
    """What one worker sustains (`splitfire planner profile` measures it on the deployed model)."""

    prefill_tps: float  # prompt tokens/s one prefill worker computes
    decode_itl: dict[int, float]  # decode batch size -> inter-token seconds at that batch

    def decode_batch_within(self, itl_slo_s: float) -> int:
        """The largest measured batch whose inter-token time meets the SLO (at least 1)."""
        ok = [b for b, itl in self.decode_itl.items() if itl <= itl_slo_s]
        return max(ok) if ok else 1

    def itl_at(self, batch: int) -> float:
        known = sorted(self.decode_itl)
        for b in known:
            if b >= batch:
                return self.decode_itl[b]
        return self.decode_itl[known[-1]] if known else 0.0


@dataclass(frozen=True)
class Snapshot:
    """One interval of the fleet, as its metrics tell it."""

    request_rate: float  # requests/s
    mean_input_tokens: float
    mean_output_tokens: float
    prefix_hit_ratio: float  # prompt tokens not computed / prompt tokens
    ttft_p90_s: float
    itl_p90_s: float
    prefill_workers: int
    decode_workers: int


@dataclass(frozen=True)
class Limits:
    min_prefill: int = 1
    max_prefill: int = 64
    min_decode: int = 1
    max_decode: int = 64

    def __post_init__(self) -> None:
        if not (0 <= self.min_prefill <= self.max_prefill and 1 <= self.min_decode <= self.max_decode):
            raise ValueError(f"planner limits must satisfy 0 <= min <= max (decode min >= 1): {self}")


@dataclass
class Decision:
    prefill: int
    decode: int
    reasons: list[str] = field(default_factory=list)


@dataclass
class Planner:
    profile: Profile
    ttft_slo_s: float
    itl_slo_s: float
    limits: Limits = field(default_factory=Limits)
    target_utilization: float = 0.8
    alpha: float = 0.3  # weight of the latest interval in the load average
    down_after: int = 3  # intervals of wanting fewer before one worker is drained
    # fewer workers are wanted only when the load fits them at this share of the target utilization: a
    # load that hovers at a whole number of workers (0.95-1.05) does not add and drain one in turn
    down_margin: float = 0.9
    correction_decay: float = 0.003  # per interval meeting the SLO: the learned correction's fade toward 1
    max_correction: float = 4.0
    _rate: float | None = None
    # mean prompt and output tokens per request, as last seen (an interval in which no request ended says
    # nothing of the output)
    _means: tuple[float, float] = (0.0, 0.0)
    _below: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    # learned: what the role's load is multiplied by (>= 1), and whether the last decision added workers
    correction: dict[str, float] = field(default_factory=lambda: {"prefill": 1.0, "decode": 1.0})
    _added: dict[str, bool] = field(default_factory=lambda: {"prefill": False, "decode": False})

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.itl_slo_s <= 0:
            raise ValueError("--ttft-slo and --itl-slo must be positive")
        if (not 0 < self.target_utilization <= 1 or not 0 < self.alpha <= 1 or self.down_after < 1
                or not 0 < self.down_margin <= 1):
            raise ValueError("target_utilization, alpha and down_margin in (0, 1], down_after >= 1")
        if self.profile.prefill_tps <= 0 or not self.profile.decode_itl:
            raise ValueError("the profile needs prefill tokens/s and at least one decode batch's ITL")

    def learned(self) -> dict[str, object]:
        """What this planner has learned, with the SLOs and profile it learned against (JSON-ready)."""
        return {"ttft_slo_s": self.ttft_slo_s, "itl_slo_s": self.itl_slo_s,
                "profile": {"prefill_tps": self.profile.prefill_tps,
                            "decode_itl": {str(b): v for b, v in sorted(self.profile.decode_itl.items())}},
                "correction": dict(self.correction), "rate": self._rate, "means": list(self._means)}

    def resume(self, state: dict[str, object]) -> None:
        """Go on from an earlier planner's `learned()`. Raises ValueError naming what differs when it was
        learned against other SLOs or another profile, or is not such a state."""
        mine = self.learned()
        for key, what in (("ttft_slo_s", "TTFT SLO"), ("itl_slo_s", "ITL SLO"), ("profile", "profile")):
            if state.get(key) != mine[key]:
                raise ValueError(f"learned against another {what}: {state.get(key)!r}, this planner's is "
                                 f"{mine[key]!r}")
        corr, rate, means = state.get("correction"), state.get("rate"), state.get("means")
        if (not isinstance(corr, dict) or set(corr) != {"prefill", "decode"}
                or not all(isinstance(v, (int, float)) and 1.0 <= v <= self.max_correction for v in corr.values())
                or not (rate is None or (isinstance(rate, (int, float)) and rate >= 0))
                or not (isinstance(means, list) and len(means) == 2
                        and all(isinstance(v, (int, float)) and v >= 0 for v in means))):
            raise ValueError(f"not a planner state (correction {corr!r}, rate {rate!r}, means {means!r})")
        self.correction = {role: float(v) for role, v in corr.items()}
        self._rate = None if rate is None else float(rate)
        self._means = (float(means[0]), float(means[1]))

    def predicted_rate(self, s: Snapshot) -> float:
        self._rate = s.request_rate if self._rate is None else (
            self.alpha * s.request_rate + (1 - self.alpha) * self._rate)
        return max(self._rate, s.request_rate)

    def means(self, s: Snapshot) -> tuple[float, float]:
        """(mean prompt tokens, mean output tokens) per request: the interval's, or the last ones seen when it
        has none (no request arrived, or none ended: the router counts prompts on arrival, outputs at the end)."""
        inp, out = self._means
        self._means = (s.mean_input_tokens or inp, s.mean_output_tokens or out)
        return self._means

    def loads(self, s: Snapshot, rate: float) -> tuple[float, float]:
        """Each role's load at `rate` in workers, by the profile alone (fractional)."""
        mean_input, mean_output = self.means(s)
        tokens = rate * mean_input * (1.0 - min(max(s.prefix_hit_ratio, 0.0), 1.0))
        prefill = tokens / (self.profile.prefill_tps * self.target_utilization)
        batch = self.profile.decode_batch_within(self.itl_slo_s)
        streams = rate * mean_output * self.profile.itl_at(batch)
        return prefill, streams / (batch * self.target_utilization)

    def needed(self, s: Snapshot, rate: float) -> tuple[int, int]:
        """Workers each role needs for `rate` by the profile alone."""
        prefill, decode = self.loads(s, rate)
        return math.ceil(prefill), max(math.ceil(decode), 1 if rate > 0 else 0)

    def decide(self, s: Snapshot) -> Decision:
        rate = self.predicted_rate(s)
        load = dict(zip(("prefill", "decode"), self.loads(s, rate), strict=True))
        have = {"prefill": s.prefill_workers, "decode": s.decode_workers}
        missed = {"prefill": s.ttft_p90_s > self.ttft_slo_s, "decode": s.itl_p90_s > self.itl_slo_s}
        d = Decision(s.prefill_workers, s.decode_workers)
        want, fits = {}, {}  # (fits: the fewest workers the load fits at the down margin)
        for role in ("prefill", "decode"):
            c = self.correction[role]
            if not missed[role]:
                c = max(1.0, c * (1.0 - self.correction_decay))
            want[role] = math.ceil(round(load[role] * c, 9))
            fits[role] = math.ceil(round(load[role] * c / self.down_margin, 9))
            if missed[role] and want[role] <= have[role] and not self._added[role]:
                # Not just scaled up (whose new workers are still starting, or draining the backlog they
                # inherited): a capacity error of the profile. One more worker, and learn it.
                if load[role] > 0:
                    c = min(max(c, (have[role] + 1) / load[role]), self.max_correction)
                want[role] = have[role] + 1
                slo = (f"TTFT p90 {s.ttft_p90_s:.2f} s > {self.ttft_slo_s:.2f} s" if role == "prefill" else
                       f"ITL p90 {s.itl_p90_s * 1e3:.0f} ms > {self.itl_slo_s * 1e3:.0f} ms")
                d.reasons.append(f"{slo}: one more {role} worker (correction x{c:.2f})")
            self.correction[role] = c
        want["decode"] = max(want["decode"], 1 if rate > 0 else 0)
        for role in ("prefill", "decode"):  # (an SLO miss's extra worker is wanted whatever the margin says)
            fits[role] = max(fits[role], want[role]) if missed[role] else fits[role]
        d.reasons.insert(0, f"predicted {rate:.2f} req/s: {load['prefill']:.2f} prefill and {load['decode']:.2f} "
                            f"decode workers of load by the profile, corrected x{self.correction['prefill']:.2f} / "
                            f"x{self.correction['decode']:.2f}: want {want['prefill']} prefill, {want['decode']} "
                            "decode")
        d.prefill = self._step("prefill", s.prefill_workers, want["prefill"], fits["prefill"],
                               self.limits.min_prefill, self.limits.max_prefill, d.reasons)
        d.decode = self._step("decode", s.decode_workers, want["decode"], fits["decode"], self.limits.min_decode,
                              self.limits.max_decode, d.reasons)
        self._added = {"prefill": d.prefill > s.prefill_workers, "decode": d.decode > s.decode_workers}
        return d

    def _step(self, role: str, have: int, want: int, fits: int, lo: int, hi: int, reasons: list[str]) -> int:
        want = min(max(want, lo), hi)
        if want > have:
            self._below[role] = 0
            return want
        if want < have and fits < have:
            self._below[role] += 1
            if self._below[role] >= self.down_after:
                self._below[role] = 0
                reasons.append(f"{role}: fewer wanted for {self.down_after} intervals: drain one")
                return max(have - 1, lo)
            return have
        self._below[role] = 0
        return max(min(have, hi), lo)
