"""`splitfire planner profile` and `splitfire planner run`.

`run` reads the router's /metrics every `--interval` seconds and prints, one JSON line per interval,
how many prefill and decode workers the next interval needs (`planner/decision.py`) and why; with
`--scale-deployments P,D` it also sets those Deployments' replicas (`planner/kubernetes.py`, the scale
subresource). `splitfire up --planner` applies the same decisions to its own worker processes
(`splitfire_cli/supervisor.LocalScaler`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import AsyncIterator

import aiohttp

from planner.decision import Limits, Planner, Snapshot
from planner.kubernetes import DeploymentScaler, KubeAPI
from planner.metrics import Scrape, snapshot
from planner.profile import load, measure, save
from planner.state import resume as resume_state
from planner.state import save as save_state

log = logging.getLogger("splitfire.planner")


async def scrape(session: aiohttp.ClientSession, url: str) -> Scrape:
    async with session.get(url + "/metrics") as r:
        if r.status != 200:
            raise OSError(f"{url}/metrics answered {r.status}")
        return Scrape.parse(await r.text(), time.monotonic())


async def watch(session: aiohttp.ClientSession, url: str, interval_s: float, sample_s: float
                ) -> AsyncIterator[Snapshot]:
    """Each interval's snapshot of the router at `url`, read every `sample_s` (at least once an interval): the
    scrapes in between measure the arrivals' bursts (`planner.metrics.prompt_peaks`)."""
    if interval_s <= 0 or sample_s <= 0:
        raise ValueError(f"the interval ({interval_s}) and the sample period ({sample_s}) must be positive")
    n = max(round(interval_s / sample_s), 1)
    before = await scrape(session, url)
    while True:
        between = []
        for _ in range(n - 1):
            await asyncio.sleep(interval_s / n)
            between.append(await scrape(session, url))
        await asyncio.sleep(interval_s / n)
        after = await scrape(session, url)
        yield snapshot(before, after, between)
        before = after


def scaler_from(args: argparse.Namespace) -> DeploymentScaler | None:
    if not args.scale_deployments:
        if args.kubeconfig:
            raise ValueError("--kubeconfig is for --scale-deployments (which Deployments to size)")
        return None
    prefill, sep, decode = args.scale_deployments.partition(",")
    if not sep or not prefill or not decode:
        raise ValueError(f"--scale-deployments expects PREFILL,DECODE Deployment names, got {args.scale_deployments!r}")
    api = KubeAPI.from_kubeconfig(args.kubeconfig) if args.kubeconfig else KubeAPI.in_cluster()
    return DeploymentScaler(api, args.namespace, {"prefill": prefill, "decode": decode})


async def run(args: argparse.Namespace) -> int:
    planner = Planner(load(args.profile), args.ttft_slo, args.itl_slo,
                      Limits(args.min_prefill, args.max_prefill, args.min_decode, args.max_decode),
                      interval_s=args.interval, lead_s=args.startup)
    if args.state and resume_state(planner, args.state):
        log.info("event=planner_resumed state=%s correction_prefill=%.3f correction_decode=%.3f", args.state,
                 planner.correction["prefill"], planner.correction["decode"])
    scaler = scaler_from(args)
    url = args.router.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async for measured in watch(s, url, args.interval, args.sample):
            snap = dataclasses.replace(measured, at_s=time.time())  # (the day: UTC's)
            if scaler is not None:  # the Deployments' own counts (pods starting count: no second start)
                snap = snap.actuated(await scaler.replicas(s, "prefill"), await scaler.replicas(s, "decode"))
            d = planner.decide(snap)
            if args.state:
                save_state(planner, args.state)
            if scaler is not None:
                for role, want, have in (("prefill", d.prefill, snap.prefill_workers),
                                         ("decode", d.decode, snap.decode_workers)):
                    if want != have:
                        await scaler.scale(s, role, want)
                        log.info("event=planner_scaled role=%s deployment=%s from=%d to=%d", role,
                                 scaler.deployments[role], have, want)
            log.info("event=planner_decision prefill=%d decode=%d have_prefill=%d have_decode=%d rate=%.2f "
                     "ttft_p90_s=%.3f itl_p90_s=%.3f", d.prefill, d.decode, snap.prefill_workers, snap.decode_workers,
                     snap.request_rate, snap.ttft_p90_s, snap.itl_p90_s)
            print(json.dumps({"prefill": d.prefill, "decode": d.decode, "have": {"prefill": snap.prefill_workers,
                              "decode": snap.decode_workers}, "snapshot": snap.__dict__, "reasons": d.reasons}),
                  flush=True)
            if args.once:
                return 0
    raise AssertionError("watch() yields for as long as the planner runs")


def _profile(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    if args.prompt_len <= 16 or args.kv_tokens < 0:
        raise ValueError("--prompt-len must exceed the decode runs' 16-token prompts; --kv-tokens >= 0")
    p = asyncio.run(measure(args.router.rstrip("/"), args.model, batches, args.prompt_len, args.decode_tokens,
                            args.rounds, args.vocab))
    p = dataclasses.replace(p, kv_tokens=args.kv_tokens)
    save(p, args.out)
    print(f"prefill {p.prefill_tps:.0f} prompt tokens/s; decode ITL "
          + ", ".join(f"batch {b}: {s * 1e3:.1f} ms" for b, s in sorted(p.decode_itl.items())) + f" -> {args.out}")
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    pp = sub.add_parser("planner", help="size the prefill and decode roles from the fleet's metrics and SLOs")
    psub = pp.add_subparsers(dest="planner_command", required=True)
    pr = psub.add_parser("profile", help="measure one worker's prompt tokens/s and inter-token time by batch")
    pr.add_argument("--router", required=True, help="the router's URL, in front of one prefill + one decode worker")
    pr.add_argument("--model", required=True, help="the served model name")
    pr.add_argument("--batches", default="1,4,16,32", help="decode batch sizes to measure")
    pr.add_argument("--prompt-len", type=int, default=512)
    pr.add_argument("--kv-tokens", type=int, default=0, help="tokens one decode worker's KV cache holds (its start-up "
                    "log's kv_blocks x block size): caps the batch the planner sizes decode for; 0: no cap")
    pr.add_argument("--decode-tokens", type=int, default=32)
    pr.add_argument("--rounds", type=int, default=3)
    pr.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    pr.add_argument("--out", default="planner-profile.json")
    pr.set_defaults(func=_profile)
    rn = psub.add_parser("run", help="print each interval's recommended prefill and decode workers (JSON lines)")
    rn.add_argument("--router", required=True, help="the router's URL (its /metrics is read)")
    rn.add_argument("--profile", required=True, help="from `splitfire planner profile`")
    rn.add_argument("--ttft-slo", type=float, required=True, help="seconds (p90)")
    rn.add_argument("--itl-slo", type=float, required=True, help="seconds (p90)")
    rn.add_argument("--interval", type=float, default=30.0, help="seconds between decisions")
    rn.add_argument("--sample", type=float, default=5.0, help="seconds between reads of /metrics within an interval: "
                    "the arrivals' bursts over one, two and six reads size prefill for them")
    rn.add_argument("--startup", type=float, default=60.0, help="seconds a new worker takes to serve: the load is "
                    "predicted this far ahead")
    rn.add_argument("--min-prefill", type=int, default=1)
    rn.add_argument("--max-prefill", type=int, default=64)
    rn.add_argument("--min-decode", type=int, default=1)
    rn.add_argument("--max-decode", type=int, default=64)
    rn.add_argument("--once", action="store_true", help="one interval, one decision, then exit")
    rn.add_argument("--state", default="", metavar="FILE",
                    help="keep what the planner learns (its corrections, the load average) in FILE: read at start, "
                         "written after each decision, so a restart does not relearn from SLO misses")
    rn.add_argument("--scale-deployments", default="", metavar="PREFILL,DECODE",
                    help="apply the decisions: set these Deployments' replicas through their scale subresource")
    rn.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    rn.add_argument("--kubeconfig", default="", help="default: the pod's service account")
    rn.set_defaults(func=lambda a: asyncio.run(run(a)))
