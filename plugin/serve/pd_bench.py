"""An A/B of the prefill node, served: a trace through FastDeploy's Router to one prefill and one decode instance, one
stack per prefill-node profile in turn (the decode node's profile unchanged), the first profile again at the end for
the run-to-run noise. Prints one table; writes it as JSON with ``--out``.

    python -m fdsched.serve.pd_bench --trace pd-prefill \\
        --prefill-profiles baseline,examples/profiles/pd-prefill-upstream.yaml,pd_prefill_cache \\
        --decode-profile baseline --decode-num-gpu-blocks 1200

Per arm: the prefill and decode engines' own prefix-cache hit rate (``fastdeploy:hit_token_rate`` on each
instance's ``/metrics``), TTFT and E2E on the client's clock (sent -> first / last streamed token, through the
Router), KV blocks not free on each instance (sampled every 0.5 s from the engine's own accounting, seam H1: peak
and mean), and the prefill messager's transfer count (finished / failed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time

__all__ = ["main", "run_arm"]


def _sample_blocks(eng, stop: threading.Event, out: dict) -> None:
    while not stop.is_set():
        for rank, inst in enumerate(eng.instances):
            try:
                state = eng.engine_state(rank, timeout=10)
            except Exception:  # noqa: BLE001 - a missed sample is not a failed run
                continue
            used = int(state["total"]) - len(state["free"])
            out.setdefault(inst["role"], []).append(used)
        stop.wait(0.5)


def _hit_rate(text) -> float:
    for line in (text or "").splitlines():
        m = re.match(r"fastdeploy:hit_token_rate(?:\{[^}]*\})?\s+([0-9.eE+-]+)", line)
        if m:
            return float(m.group(1))
    return float("nan")


def run_arm(trace, prefill_profile: str, decode_profile: str, shape: dict, decode_blocks, time_scale: float) -> dict:
    """One stack, the whole trace through its Router; the arm's figures. The stack's run folder goes afterwards."""
    from fdsched.serve.pd import PdConfig, PdServedEngine

    config = PdConfig(prefill=1, decode=1, role_profiles=f"prefill={prefill_profile},decode={decode_profile}",
                      decode_num_gpu_blocks=decode_blocks, health_timeout=300, **shape)
    eng = PdServedEngine(config, progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    try:
        with eng:
            return _measure(eng, trace, prefill_profile, decode_profile, time_scale)
    finally:
        eng.cleanup()  # the stack's run folder (logs, state): everything reported has been read from it


def _measure(eng, trace, prefill_profile: str, decode_profile: str, time_scale: float) -> dict:
    """The arm's figures from a running stack."""
    from fdsched.serve.load import Target, run_trace_load
    from fdsched.serve.served_report import client_figures

    prefill, decode = eng.instances
    target = Target(prefill_profile, prefill["url"], prefill["metrics"], send_url=eng.router_url)
    samples, stop = {}, threading.Event()
    sampler = threading.Thread(target=_sample_blocks, args=(eng, stop, samples), daemon=True)
    sampler.start()
    load = run_trace_load(trace, [target], time_scale=time_scale, progress=False)
    stop.set()
    sampler.join()
    eng.check_alive()
    figures = client_figures(load["results"])
    log = eng.messager_log(0)
    finished = len(re.findall(r": finished \(", log))
    failed = len(re.findall(r": (?:connection error|write cache error) \(", log))
    return {
        "prefill_profile": prefill_profile, "decode_profile": decode_profile,
        "requests": figures["requests"], "finished": figures["requests_finished"], "errors": figures["errors"],
        "prefill_hit_rate": _hit_rate(eng.metrics_text(0)), "decode_hit_rate": _hit_rate(eng.metrics_text(1)),
        **{k: figures.get(k) for k in ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99")},
        "prefill_blocks_peak": max(samples.get("prefill", [0])),
        "prefill_blocks_mean": round(sum(samples.get("prefill", [0])) / max(1, len(samples.get("prefill", []))), 1),
        "decode_blocks_peak": max(samples.get("decode", [0])),
        "transfers_finished": finished, "transfers_failed": failed,
        "wall_seconds": round(load["wall_seconds"], 1),
    }


COLUMNS = (("prefill_hit_rate", "P hit rate", "{:.3f}"), ("decode_hit_rate", "D hit rate", "{:.3f}"),
           ("ttft_ms_p50", "TTFT p50 ms", "{:.0f}"), ("ttft_ms_p99", "TTFT p99 ms", "{:.0f}"),
           ("e2e_ms_p50", "E2E p50 ms", "{:.0f}"), ("e2e_ms_p99", "E2E p99 ms", "{:.0f}"),
           ("prefill_blocks_peak", "P blocks peak", "{}"), ("prefill_blocks_mean", "P blocks mean", "{}"),
           ("decode_blocks_peak", "D blocks peak", "{}"), ("transfers_finished", "transfers", "{}"),
           ("transfers_failed", "failed", "{}"), ("finished", "finished", "{}"), ("wall_seconds", "wall s", "{}"))


def format_table(rows: list) -> str:
    head = "| prefill profile | " + " | ".join(title for _k, title, _f in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for row in rows:
        cells = []
        for key, _title, fmt in COLUMNS:
            value = row.get(key)
            cells.append("n/a" if value is None else fmt.format(value))
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fdsched.serve.pd_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="pd-prefill")
    ap.add_argument("--prefill-profiles", default="baseline,pd_prefill_cache",
                    help="comma-separated profiles for the prefill node, one stack each, in turn")
    ap.add_argument("--decode-profile", default="baseline")
    ap.add_argument("--decode-num-gpu-blocks", type=int, help="the decode node's KV pool (default: the trace's)")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--no-repeat-reference", dest="repeat", action="store_false")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    from fdsched.replay.tracefile import load_trace, resolve_trace

    trace = load_trace(resolve_trace(a.trace))
    engine = dict(trace.engine or {})
    shape = {k: engine[k] for k in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                                    "max_model_len") if k in engine}
    arms = [p.strip() for p in a.prefill_profiles.split(",") if p.strip()]
    runs = arms + ([arms[0]] if a.repeat and len(arms) > 1 else [])
    rows = []
    for i, profile in enumerate(runs):
        label = profile + (" (again)" if i >= len(arms) else "")
        print(f"arm {label} ({i + 1} of {len(runs)})", file=sys.stderr, flush=True)
        row = run_arm(trace, profile, a.decode_profile, shape, a.decode_num_gpu_blocks, a.time_scale)
        row["label"] = label
        rows.append(row)
    from fdsched.install.probe import probe

    print(f"trace {trace.name}: {len(trace.requests)} requests; host {probe().label}; decode node "
          f"{a.decode_profile}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(format_table(rows))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
