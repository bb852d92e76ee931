"""How many prefill and decode workers the next interval needs: the planner's decision, from a
per-worker capacity profile, a load prediction one start-up ahead and the SLOs actually observed.

Prefill and decode load move apart (long prompts want prefill workers; long answers and many
concurrent streams want decode workers), so each role is predicted and sized on its own:

- **the load**: prompt tokens/s and output tokens/s, each predicted `lead_s` (a new worker's start-up)
  ahead by its own `planner.predictor.SeasonalTrend` (Holt's level and trend on the series divided by a
  daily profile learned from whole days: a rise is extrapolated on the first day, and foreseen from the
  second). An interval above the forecast is believed at once, beyond the down margin's band.
- **prefill**: the prompt load sized for is the forecast's upper bound — the forecast plus the
  `forecast_quantile` of how far the load ran above the forecasts made for it (`SeasonalTrend.predict`, an
  empirical prediction interval): where the load swings within a start-up time (Azure's code hour: 0 to 70
  requests/s from one minute to the next) no forecast of the mean holds the capacity the next busy minute
  needs, and on a smooth day the bound is the forecast. Then: the uncached prompt tokens/s over what one
  worker computes (`Profile.prefill_tps`) at `target_utilization`, and at least what an M/M/n queue of those
  prompts needs for all but `ttft_miss` of them to start within the TTFT SLO (Erlang C, `prefill_servers`),
  and at least what the bursts need: the router is read every few seconds (`Snapshot.prompt_peaks`: the most
  prompt tokens/s over 1, 2 and 6 reads), each window's peak above the interval's mean is kept in units of
  the deviation Poisson arrivals of these prompts would show over that window (`bursts`: (peak - m) /
  sqrt(m x E[S^2]/E[S] / w) — a ratio to the mean would call every quiet minute's few prompts a 6-12x burst
  and size the busy minutes by it), and the predicted load plus their `burst_quantile` of such deviations must
  be cleared within the TTFT budget — n x rate >= peak x w / (w + budget), the delay bound of a rate server
  under that arrival curve. Real arrivals are far burstier than Poisson (Azure's code hour: 5-second peaks
  ~10 such deviations above the minute's mean at p90), which no model of the mean sees.
- **decode**: a worker's batch settles where batch = its output tokens/s x step(batch) (Little's law), so
  the output tokens/s are sized over what one worker produces at `decode_utilization` (0.9) of the largest
  batch whose step (`Profile.step_s`: the profiled step at that batch plus the KV cache read beyond the
  profiled context) meets the ITL SLO and that its KV cache holds (`Profile.decode_capacity`), for streams
  holding the mean prompt and what a batch's streams hold of their answers on average — mean x (1 + cv^2) / 2,
  long answers staying longer (`Snapshot.output_cv2`; 1, exponential, when not measured). The headroom is kept
  in streams, where a burst lands, not in tokens/s (which would keep a second worker for a load the first
  serves at 90% of its batch).

Feedback corrects the model: a role whose observed p90 misses its SLO although the model says it has
enough gets one more worker, and the planner remembers it — the role's load is scaled by a learned
correction (what the profile overestimates of a worker in this fleet: prefix hits that do not
materialize, bursts within the interval) until the SLO is met with fewer, so the next interval does not
drain the worker it just had to add. The true need lies between the workers that missed and the one more:
the correction puts it midway (`have + 0.5`), so a marginal miss does not ask for a second worker the moment
the load ticks up. The correction is learned only from a settled fleet: neither role grew within a start-up
plus `settle_intervals` intervals (the new workers' start and the backlog they inherit are not a capacity
error, and a prefill backlog cleared floods decode with streams), and the prefill role is not clearing a
backlog (`Snapshot.first_token_rate` above the arrivals: a cold start's backlog once taught corrections of x3
that a whole steady hour then paid for). It decays slowly (`correction_decay` per interval in which the SLO
is met) so one burst does not keep workers for good. Scaling up is immediate; scaling down waits
`down_after` intervals in which the forecast alone (not the interval's noise) fits fewer workers at
`down_margin` of the target utilization — so a load at a whole number of workers does not add and drain one in
turn — and then drains one worker per interval; both stay within the role's `[min, max]`.

What it has learned (the corrections, the bursts, the predictors' level, trend and daily profile, the last means)
outlives the process: `learned()` / `resume()`, kept in a state file by `planner/state.py` (`--state`),
so a restarted planner neither relearns its fleet's corrections from SLO misses nor its day — and refused
if learned against other SLOs or another profile, whose errors the corrections measured.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Any

from planner.predictor import SeasonalTrend


@dataclass(frozen=True)
class Profile:
    """What one worker sustains (`splitfire planner profile` measures it on the deployed model)."""

    prefill_tps: float  # prompt tokens/s one prefill worker computes
    decode_itl: dict[int, float]  # decode batch size -> inter-token seconds at that batch
    # the context each stream held when `decode_itl` was measured, and what a step takes longer per token of
    # context beyond it (reading the KV cache): a batch of long conversations steps slower than the profile's
    profiled_context: float = 0.0
    kv_s_per_token: float = 0.0
    kv_tokens: int = 0  # KV cache one decode worker holds, tokens (0: not known, not a limit)
    # what a prefill worker spends per prompt beside its tokens (scheduling, the KV hand-off): short prompts are
    # dearer per token than `prefill_tps` alone says
    prefill_overhead_s: float = 0.0

    def prefill_work(self, tokens_per_s: float, prompts_per_s: float) -> float:
        """Seconds of one prefill worker's time per second for this many uncached prompt tokens and prompts."""
        return tokens_per_s / self.prefill_tps + prompts_per_s * self.prefill_overhead_s

    def step_s(self, batch: float, context: float) -> float:
        """One decode step of `batch` streams of `context` tokens each: the profile's time at that batch
        (linear between measured batches) plus reading their context beyond the profiled one."""
        known = sorted(self.decode_itl)
        i = bisect.bisect_left(known, batch)
        if i == 0:
            base = self.decode_itl[known[0]]
        elif i == len(known):
            base = self.decode_itl[known[-1]]
        else:
            a, b = known[i - 1], known[i]
            base = self.decode_itl[a] + (self.decode_itl[b] - self.decode_itl[a]) * (batch - a) / (b - a)
        return base + batch * max(context - self.profiled_context, 0.0) * self.kv_s_per_token

    def decode_capacity(self, itl_slo_s: float, context: float) -> tuple[int, float]:
        """(batch, output tokens/s) of one decode worker at its best within the ITL SLO and its KV cache, for
        streams of `context` tokens: the largest batch up to the largest measured whose step meets the SLO."""
        best = 1
        for b in range(1, max(self.decode_itl) + 1):
            if self.step_s(b, context) > itl_slo_s or (self.kv_tokens and b * context > self.kv_tokens):
                break
            best = b
        return best, best / self.step_s(best, context)

    def decode_batch_within(self, itl_slo_s: float) -> int:
        """The largest measured batch whose inter-token time meets the SLO (at least 1)."""
        ok = [b for b, itl in self.decode_itl.items() if itl <= itl_slo_s]
        return max(ok) if ok else 1


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
    # when the interval ended, in seconds on a clock whose day is the load's day (the wall clock live; the
    # trace's clock in the simulator): the predictor's daily season. None: the planner counts intervals.
    at_s: float | None = None
    # (window seconds, the most prompt tokens/s over any window that long within the interval): how bursty the
    # arrivals were, from scrapes every few seconds (`planner.metrics.prompt_peaks`). Empty: not measured.
    prompt_peaks: tuple[tuple[float, float], ...] = ()
    # requests/s that got their first token in the interval: above the arrivals, the prefill role is clearing a
    # backlog (its TTFTs are the backlog's, not its capacity's). None: not measured.
    first_token_rate: float | None = None
    # the squared coefficient of variation of the interval's prompt lengths (variance over the squared mean): long
    # prompts among short ones queue the short ones (M/G/n). None: not measured (taken as exponential, 1).
    prompt_cv2: float | None = None
    # the same of the answers' lengths: a decode batch holds long answers longer, so its streams' mean context is
    # the prompt plus E[out^2] / (2 E[out]) = mean x (1 + cv2) / 2, not half the mean answer. None: taken as 1.
    output_cv2: float | None = None
    # (prefill, decode) workers serving — in the router's rotation — when the counts above are an actuator's, which
    # count a worker from the moment it was asked for (`actuated`). Fewer serving than counted: workers are still
    # starting, and the SLO misses meanwhile say nothing about the profile. None: every counted worker serves.
    serving: tuple[int, int] | None = None

    def actuated(self, prefill: int, decode: int, **changes: Any) -> Snapshot:
        """This snapshot with the actuator's worker counts (a Deployment's replicas, `splitfire up`'s processes:
        starting workers included, so one need does not start two), keeping the router's as `serving`."""
        return replace(self, prefill_workers=prefill, decode_workers=decode,
                       serving=(self.prefill_workers, self.decode_workers), **changes)


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
    # decode: the share of the largest batch within the ITL SLO and KV cache a worker is sized to hold (the batch's
    # step is already sized for the SLO at the streams' real context: at 0.8, like prefill, a second decode worker was
    # held through the Azure conversation hour where one served all but five minutes of it in hindsight)
    decode_utilization: float = 0.9
    alpha: float = 0.25  # the predictors' level weight (Holt's alpha) and the hit ratio's smoothing
    down_after: int = 3  # intervals of wanting fewer before one worker is drained
    # fewer workers are wanted only when the load fits them at this share of the target utilization: a
    # load that hovers at a whole number of workers (0.95-1.05) does not add and drain one in turn
    down_margin: float = 0.85
    correction_decay: float = 0.003  # per interval meeting the SLO: the learned correction's fade toward 1
    max_correction: float = 4.0
    # prefill: the share of prompts the queueing model lets wait past the TTFT SLO (half of what a p90 SLO allows)
    ttft_miss: float = 0.05
    interval_s: float = 30.0  # how often `decide` is called: the predictors' step
    lead_s: float = 60.0  # a new worker's start-up: the load is predicted this far ahead
    trend_weight: float = 0.05  # the predictors' trend weight (Holt's beta)
    # prefill is sized for the prompt forecast plus this quantile of how far the load has run above its forecasts
    # (`SeasonalTrend.predict`: an empirical prediction interval over the newest 120 intervals); decode for the forecast
    forecast_quantile: float = 0.75
    # an SLO miss teaches a correction only once the fleet's last new workers have served this many whole intervals
    # (before, the miss is their start-up or the backlog they inherited, not an error of the profile)
    settle_intervals: int = 2
    _clock: float = 0.0  # (seconds counted by intervals, for snapshots that carry no time)
    _forecast: tuple[float, float] = (0.0, 0.0)  # the predictors' last (prompt, output) tokens/s
    # The bursts: per window of `Snapshot.prompt_peaks`, the most prompt tokens/s over such a window within an
    # interval over the interval's mean (the last `burst_window` intervals'); the predicted prompt load is taken
    # to burst by their `burst_quantile`.
    bursts: dict[float, list[float]] = field(default_factory=dict)
    burst_quantile: float = 0.9
    # the share of a prefill worker the burst rule sizes for (the utilization rule's `target_utilization` apart: at
    # 1.0 the Azure conversation hour took 3.95 worker-hours instead of 4.13, but the code hour's bursts then missed)
    burst_utilization: float = 0.8
    burst_window: int = 120
    _peaks: dict[float, float] = field(default_factory=dict)  # window s -> predicted prompt tokens/s over it
    _hit: float | None = None  # the prefix hit ratio, smoothed
    _prefill_rule: str = ""  # which rule sized prefill in the last `token_loads` (for the decision's reasons)
    _cv2: float = 1.0  # the prompts' squared coefficient of variation, smoothed
    _out_cv2: float = 1.0  # the answers', smoothed
    # the load one start-up ahead, per role: prompt tokens/s (prefill) and output tokens/s (decode)
    predictors: dict[str, SeasonalTrend] = field(default_factory=dict)
    # mean prompt and output tokens per request, as last seen (an interval in which no request ended says
    # nothing of the output)
    _means: tuple[float, float] = (0.0, 0.0)
    _below: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    # learned: what the role's load is multiplied by (>= 1), and the intervals since the role last grew
    correction: dict[str, float] = field(default_factory=lambda: {"prefill": 1.0, "decode": 1.0})
    _since_grown: dict[str, int] = field(default_factory=lambda: {"prefill": 1 << 30, "decode": 1 << 30})

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.itl_slo_s <= 0:
            raise ValueError("--ttft-slo and --itl-slo must be positive")
        if (not 0 < self.target_utilization <= 1 or not 0 < self.decode_utilization <= 1 or not 0 < self.alpha <= 1
                or not 0 < self.burst_utilization <= 1
                or self.down_after < 1 or not 0 < self.down_margin <= 1 or not 0 <= self.forecast_quantile <= 1
                or not 0 <= self.burst_quantile <= 1):
            raise ValueError("target_utilization, decode_utilization, burst_utilization, alpha and down_margin in (0, 1], "
                             "forecast_quantile and burst_quantile in [0, 1], down_after >= 1")
        if self.profile.prefill_tps <= 0 or not self.profile.decode_itl:
            raise ValueError("the profile needs prefill tokens/s and at least one decode batch's ITL")
        if (self.interval_s <= 0 or self.lead_s < 0 or not 0 < self.trend_weight <= 1
                or self.settle_intervals < 0):
            raise ValueError("the planner's interval must be positive, its lead >= 0, its trend weight in (0, 1], "
                             "settle_intervals >= 0")
        self.predictors = self.predictors or {
            role: SeasonalTrend(self.interval_s, alpha=self.alpha, beta=self.trend_weight)
            for role in ("prefill", "decode")}

    def learned(self) -> dict[str, object]:
        """What this planner has learned, with the SLOs and profile it learned against (JSON-ready)."""
        return {"ttft_slo_s": self.ttft_slo_s, "itl_slo_s": self.itl_slo_s,
                "profile": {"prefill_tps": self.profile.prefill_tps,
                            "decode_itl": {str(b): v for b, v in sorted(self.profile.decode_itl.items())}},
                "correction": dict(self.correction), "means": list(self._means),
                "burst_excess": {f"{w:g}": [round(r, 4) for r in v] for w, v in sorted(self.bursts.items())},
                "predictors": {role: p.to_state() for role, p in self.predictors.items()}}

    def resume(self, state: dict[str, object]) -> None:
        """Go on from an earlier planner's `learned()`. Raises ValueError naming what differs when it was
        learned against other SLOs or another profile, or is not such a state."""
        mine = self.learned()
        for key, what in (("ttft_slo_s", "TTFT SLO"), ("itl_slo_s", "ITL SLO"), ("profile", "profile")):
            if state.get(key) != mine[key]:
                raise ValueError(f"learned against another {what}: {state.get(key)!r}, this planner's is "
                                 f"{mine[key]!r}")
        corr, means, predictors = state.get("correction"), state.get("means"), state.get("predictors", {})
        # (a state written before bursts were measured as excesses has none: its "bursts", ratios, are not used)
        bursts = state.get("burst_excess", {})
        if (not isinstance(corr, dict) or set(corr) != {"prefill", "decode"}
                or not all(isinstance(v, (int, float)) and 1.0 <= v <= self.max_correction for v in corr.values())
                or not (isinstance(means, list) and len(means) == 2
                        and all(isinstance(v, (int, float)) and v >= 0 for v in means))
                or not isinstance(predictors, dict) or not set(predictors) <= {"prefill", "decode"}
                or not isinstance(bursts, dict) or not all(
                    _positive(w) and isinstance(v, list) and all(isinstance(r, (int, float)) and r >= 0 for r in v)
                    for w, v in bursts.items())):
            raise ValueError(f"not a planner state (correction {corr!r}, means {means!r}, bursts {bursts!r})")
        for role, p in predictors.items():  # (a state written before the predictors: they start afresh)
            self.predictors[role].from_state(p)
        self.correction = {role: float(v) for role, v in corr.items()}
        self._means = (float(means[0]), float(means[1]))
        self.bursts = {float(w): [float(r) for r in v][-self.burst_window:] for w, v in bursts.items()}

    def predicted(self, s: Snapshot) -> tuple[float, float]:
        """(prompt tokens/s, output tokens/s) to size for: each the larger of the interval's and its predictor's
        forecast one start-up ahead — a rise is answered at once (or before it comes, once the day is known),
        a dip is believed as the level and trend follow it down."""
        t = s.at_s if s.at_s is not None else self._clock + self.interval_s
        self._clock = t
        mean_input, mean_output = self.means(s)
        now = {"prefill": s.request_rate * mean_input, "decode": s.request_rate * mean_output}
        for role, p in self.predictors.items():
            p.observe(t, now[role])
        cv2 = s.prompt_cv2 if s.prompt_cv2 is not None else self._cv2
        # the prompt tokens one arrival brings as a compound Poisson count's variance weighs them, E[S^2] / E[S]:
        # over a window of w seconds such arrivals at a mean of m tokens/s deviate by sqrt(m x unit / w) tokens/s
        unit = mean_input * (1.0 + max(cv2, 0.0))
        if now["prefill"] > 0 and unit > 0:  # (an idle interval has no burst to measure)
            for w, peak in s.prompt_peaks:
                shapes = self.bursts.setdefault(w, [])
                shapes.append(min(max((peak - now["prefill"]) / math.sqrt(now["prefill"] * unit / w), 0.0), 1e3))
                del shapes[: -self.burst_window]
        # prefill sizes for the forecast's upper bound (its load is instantaneous: a minute that swings above the
        # forecast queues at once); decode for the forecast (a stream stays for its whole answer, so its batch
        # follows the arrivals smoothly, and its headroom is already kept in streams)
        (_, prompt_up), (output, _) = (self.predictors[role].predict(t, self.lead_s, self.forecast_quantile)
                                       for role in ("prefill", "decode"))
        self._forecast = (prompt_up, output)
        prompt = max(now["prefill"] * self.down_margin, self._forecast[0])
        self._peaks = {w: prompt + self._quantile(shapes) * math.sqrt(prompt * unit / w)
                       for w, shapes in self.bursts.items()}
        # (an interval above the forecast is believed at once, but only beyond the down margin's band: a noisy
        # steady load's peaks within it do not add the worker its forecast would drain again)
        return prompt, max(now["decode"] * self.down_margin, self._forecast[1])

    def _quantile(self, shapes: list[float]) -> float:
        """`burst_quantile` of a window's burst excesses (their mean until ten are known)."""
        if len(shapes) < 10:
            return sum(shapes) / len(shapes) if shapes else 0.0
        ordered = sorted(shapes)
        return ordered[min(int(self.burst_quantile * len(ordered)), len(ordered) - 1)]

    def means(self, s: Snapshot) -> tuple[float, float]:
        """(mean prompt tokens, mean output tokens) per request: the interval's, or the last ones seen when it
        has none (no request arrived, or none ended: the router counts prompts on arrival, outputs at the end)."""
        inp, out = self._means
        self._means = (s.mean_input_tokens or inp, s.mean_output_tokens or out)
        return self._means

    def loads(self, s: Snapshot, rate: float) -> tuple[float, float]:
        """Each role's load at `rate` requests/s with the snapshot's token means, in workers (fractional)."""
        mean_input, mean_output = self.means(s)
        return self.token_loads(rate * mean_input, rate * mean_output, s.prefix_hit_ratio, mean_input, mean_output)

    def token_loads(self, prompt_tps: float, output_tps: float, hit_ratio: float, mean_input: float,
                    mean_output: float, margin: float = 1.0,
                    peaks: dict[float, float] | None = None) -> tuple[float, float]:
        """Each role's load in workers by the profile alone (fractional), at `margin` of the target utilization.

        Prefill: the uncached prompt tokens/s over what a worker computes at the target utilization, and at
        least the workers an M/M/n queue of these prompts needs for all but `ttft_miss` of them to start within
        the TTFT SLO (Erlang C: a burst of long prompts queues well before the workers are busy on average).
        Decode: the output tokens/s over what one worker produces at its largest batch within the ITL SLO and its
        KV cache, for streams holding the mean prompt and half the mean answer (long conversations step slower).
        """
        uncached = 1.0 - min(max(hit_ratio, 0.0), 1.0)
        tokens = prompt_tps * uncached / margin
        prompts = prompt_tps / mean_input / margin if mean_input > 0 else 0.0
        prefill = self.profile.prefill_work(tokens, prompts) / self.target_utilization
        self._prefill_rule = "utilization"
        service_s = self.profile.prefill_work(mean_input * uncached, 1.0)
        if tokens > 0 and 0 < service_s < self.ttft_slo_s:  # (a prompt that alone takes longer: no count helps)
            budget = self.ttft_slo_s - service_s
            queue = prefill_servers(prompts, service_s, budget, self.ttft_miss, cv2=self._cv2)
            if queue > prefill:
                prefill, self._prefill_rule = queue, "queue"
            # A burst: `r` times the mean for `w` seconds queues (r x work - n) x w seconds of work, which n
            # workers clear within the budget when n >= r x work x w / (w + budget) (network calculus' delay
            # bound of a rate server under the arrival curve the bursts trace).
            for w, peak in (peaks or {}).items():
                work = self.profile.prefill_work(peak * uncached / margin, peak / mean_input / margin)
                cleared = work * w / (w + budget) / self.burst_utilization
                if cleared > prefill:
                    prefill, self._prefill_rule = cleared, f"{w:g}-s bursts"
        # Decode: a worker's batch at its load settles where batch = output tokens/s x step(batch) (Little's law);
        # the load it takes is the rate at which that batch is `decode_utilization` (x margin) of the largest that
        # meets the ITL SLO and fits its KV cache — the headroom is in streams, where a burst lands. Each stream
        # stays for as long as its answer, so long answers weigh by their length in the batch's context.
        context = mean_input + mean_output * (1.0 + self._out_cv2) / 2
        best, _ = self.profile.decode_capacity(self.itl_slo_s, context)
        batch = max(best * self.decode_utilization * margin, 1.0)
        return prefill, output_tps / (batch / self.profile.step_s(batch, context))

    def needed(self, s: Snapshot, rate: float) -> tuple[int, int]:
        """Workers each role needs for `rate` by the profile alone."""
        prefill, decode = self.loads(s, rate)
        return math.ceil(prefill), max(math.ceil(decode), 1 if rate > 0 else 0)

    def decide(self, s: Snapshot) -> Decision:
        prompt_tps, output_tps = self.predicted(s)
        # the prefix hit ratio, smoothed as the level is: its noise moves the uncached prompt, and the queue's
        # service time with it
        hit = s.prefix_hit_ratio if self._hit is None else self.alpha * s.prefix_hit_ratio + (1 - self.alpha) * self._hit
        self._hit = hit
        if s.prompt_cv2 is not None and s.request_rate > 0:
            self._cv2 = self.alpha * s.prompt_cv2 + (1 - self.alpha) * self._cv2
        if s.output_cv2 is not None and s.request_rate > 0:
            self._out_cv2 = self.alpha * s.output_cv2 + (1 - self.alpha) * self._out_cv2
        load = dict(zip(("prefill", "decode"), self.token_loads(prompt_tps, output_tps, hit, *self._means,
                                                                peaks=self._peaks), strict=True))
        rule = self._prefill_rule
        # the load were it to fit at the down margin, by the forecast alone (not the interval's noise): fewer
        # workers are wanted only below this
        slack = dict(zip(("prefill", "decode"), self.token_loads(*self._forecast, hit, *self._means,
                                                                 margin=self.down_margin, peaks=self._peaks),
                         strict=True))
        busy = s.request_rate > 0 or output_tps > 0
        have = {"prefill": s.prefill_workers, "decode": s.decode_workers}
        missed = {"prefill": s.ttft_p90_s > self.ttft_slo_s, "decode": s.itl_p90_s > self.itl_slo_s}
        d = Decision(s.prefill_workers, s.decode_workers)
        want, fits = {}, {}  # (fits: the fewest workers the load fits at the down margin)
        if s.serving is not None:  # (a role whose new workers do not serve yet has just grown, whatever `lead_s` says)
            for role, serving, counted in zip(("prefill", "decode"), s.serving, (s.prefill_workers, s.decode_workers),
                                              strict=True):
                if serving < counted:
                    self._since_grown[role] = 0
        # (clearing a backlog: more requests got their first token than arrived — its misses are the backlog's)
        settled = (min(self._since_grown.values()) >= self.settled_after
                   and (s.first_token_rate is None or s.first_token_rate <= 1.1 * s.request_rate))
        for role in ("prefill", "decode"):
            c = self.correction[role]
            if not missed[role]:
                c = max(1.0, c * (1.0 - self.correction_decay))
            want[role] = math.ceil(round(load[role] * c, 9))
            fits[role] = math.ceil(round(slack[role] * c, 9))
            if missed[role] and want[role] <= have[role] and settled:
                # Neither role just scaled up (new workers still starting, or draining the backlog they inherited —
                # and a prefill backlog cleared floods decode with streams): a capacity error of the profile. One
                # more worker, and learn it.
                if load[role] > 0:
                    c = min(max(c, (have[role] + 0.5) / load[role]), self.max_correction)
                want[role] = have[role] + 1
                slo = (f"TTFT p90 {s.ttft_p90_s:.2f} s > {self.ttft_slo_s:.2f} s" if role == "prefill" else
                       f"ITL p90 {s.itl_p90_s * 1e3:.0f} ms > {self.itl_slo_s * 1e3:.0f} ms")
                d.reasons.append(f"{slo}: one more {role} worker (correction x{c:.2f})")
            self.correction[role] = c
        want["decode"] = max(want["decode"], 1 if busy else 0)
        # A role that misses its SLO, or whose prefill is still clearing a backlog, is never drained (its forecast can
        # fall while its queue is minutes long), and an SLO miss's extra worker is wanted whatever the margin says.
        clearing = s.first_token_rate is not None and s.first_token_rate > 1.1 * s.request_rate
        for role in ("prefill", "decode"):
            if missed[role] or (role == "prefill" and clearing):
                fits[role] = max(fits[role], want[role], have[role])
        d.reasons.insert(0, f"predicted {prompt_tps:.0f} prompt and {output_tps:.0f} output tokens/s "
                            f"{self.lead_s:g} s ahead: {load['prefill']:.2f} prefill (by {rule}) and {load['decode']:.2f} "
                            f"decode workers of load by the profile, corrected x{self.correction['prefill']:.2f} / "
                            f"x{self.correction['decode']:.2f}: want {want['prefill']} prefill, {want['decode']} "
                            "decode")
        d.prefill = self._step("prefill", s.prefill_workers, want["prefill"], fits["prefill"],
                               self.limits.min_prefill, self.limits.max_prefill, d.reasons)
        d.decode = self._step("decode", s.decode_workers, want["decode"], fits["decode"], self.limits.min_decode,
                              self.limits.max_decode, d.reasons)
        for role, now_, before in (("prefill", d.prefill, s.prefill_workers), ("decode", d.decode, s.decode_workers)):
            self._since_grown[role] = 0 if now_ > before else self._since_grown[role] + 1
        return d

    @property
    def settled_after(self) -> int:
        """Decisions after one that grew a role before its SLO misses teach a correction: the new workers' start-up
        (`lead_s`), then `settle_intervals` whole intervals of serving."""
        return math.ceil(round(self.lead_s / self.interval_s, 9)) + self.settle_intervals - 1

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


def _positive(text: object) -> bool:
    try:
        return float(str(text)) > 0
    except ValueError:
        return False


def erlang_c(n: int, a: float) -> float:
    """The probability that an arrival waits, in an M/M/n queue offered `a` = arrival rate x service time
    (< n); Erlang B's recurrence, then C from B."""
    b = 1.0
    for k in range(1, n + 1):
        b = a * b / (k + a * b)
    return n * b / (n - a * (1.0 - b))


def prefill_servers(rate: float, service_s: float, budget_s: float, miss: float, most: int = 1024,
                    cv2: float = 1.0) -> int:
    """The fewest servers for which at most `miss` of the arrivals (at `rate`/s, each `service_s` of work on
    average) wait longer than `budget_s` in an M/G/n queue whose service times have squared coefficient of variation
    `cv2`: P(wait > t) = C(n, a) exp(-(n - a) t / (service x (1 + cv2) / 2)) — Erlang C's tail with the waits
    stretched by Allen-Cunneen's factor (exact for M/M/n, cv2 = 1; prompts of mixed lengths have cv2 > 1)."""
    a = rate * service_s
    n = max(1, math.floor(a) + 1)
    stretched = service_s * (1.0 + max(cv2, 0.0)) / 2.0
    while n < most and erlang_c(n, a) * math.exp(-(n - a) * max(budget_s, 0.0) / max(stretched, 1e-12)) > miss:
        n += 1
    return n
