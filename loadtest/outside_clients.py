"""Benchmark clients written by others, against `splitfire up`: NVIDIA's aiperf drives a short
streaming chat profile (synthetic prompts from the model's own tokenizer) and must finish with
zero errors. The clients live in their own virtualenv (never in splitfire's dependencies).

    python -m loadtest.outside_clients                       # tiny random model; makes .clients-venv
    python -m loadtest.outside_clients --model smollm2 --clients-venv /opt/clients
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from loadtest.stack import ROOT, Stack

CLIENTS = ["aiperf==0.13.0"]


def clients_python(path: Path) -> Path:
    """The clients' virtualenv (created and filled with pip on first use)."""
    py = path / "bin" / "python"
    if not py.exists():
        print(f"creating {path} with {' '.join(CLIENTS)} (pip, a few minutes once)", flush=True)
        venv.create(path, with_pip=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *CLIENTS], check=True)
    return py


def run_aiperf(py: Path, url: str, model: str, tokenizer: str, out: Path, requests: int, concurrency: int) -> dict:
    cmd = [str(py.parent / "aiperf"), "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
           "--streaming", "--tokenizer", tokenizer, "--isl", "64", "--osl", "16", "--request-count", str(requests),
           "--concurrency", str(concurrency), "--artifact-dir", str(out), "--ui-type", "none", "--random-seed", "1"]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    (out / "aiperf.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"aiperf exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {out}")
    return json.loads(found[-1].read_text())


def summary(export: dict) -> dict[str, float]:
    """Request count, errors and a few medians from aiperf's JSON export."""
    def metric(name: str, stat: str = "avg") -> float:
        m = export.get(name) or {}
        return float(m.get(stat, 0) or 0)

    errors = export.get("error_summary") or []
    return {"requests": metric("request_count"), "errors": sum(int(e.get("count", 0)) for e in errors),
            "error_rate_pct": metric("request_error_rate"),
            # requests whose output length (by aiperf's own re-tokenization of the text) differs from
            # what was asked, and whose server-reported usage differs from that count
            "osl_mismatch": metric("osl_mismatch_count"), "usage_discrepancy": metric("usage_discrepancy_count"),
            "ttft_p50_ms": metric("time_to_first_token", "p50"), "itl_p50_ms": metric("inter_token_latency", "p50"),
            "output_tok_s": metric("output_token_throughput")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (a random Llama made here), smollm2, or a model directory")
    p.add_argument("--clients-venv", default=str(ROOT / ".clients-venv"))
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="outside-clients-"))
    if args.model == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_model import make_tiny_llama

        model_dir = make_tiny_llama(work / "tiny")
    else:
        from engine.loading.model_store import resolve_model

        model_dir = resolve_model(args.model)
    py = clients_python(Path(args.clients_venv))
    name = Path(model_dir).name
    with Stack("outside-clients", ["--model", str(model_dir), "--prefill", "1", "--decode", "1", "--no-redis"],
               work) as stack:
        result = summary(run_aiperf(py, stack.url, name, str(model_dir), work / "aiperf", args.requests,
                                    args.concurrency))
    print(f"aiperf against splitfire up (1 prefill + 1 decode, {name}): " +
          ", ".join(f"{k} {v:g}" for k, v in result.items()))
    ok = result["errors"] == 0 and result["requests"] >= args.requests
    print("zero errors: " + ("yes" if ok else "NO") + f" (artifacts: {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
