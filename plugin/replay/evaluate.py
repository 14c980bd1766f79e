"""``fdsched eval``: every reference arm on the held-out evaluation windows, one table.

The split of the imported real traces into tuning and evaluation windows is data
(``fdsched/replay/windows.yaml``), fixed before any arm ran on the evaluation windows; the reasoning
is in docs/evaluation.md. For each evaluation window and each clients' ``max_tokens`` mode
(``unset``: null; ``true``: the request's true output length) the window is imported from its CSV
(:mod:`fdsched.replay.importer`) unless the same window ships as a trace (``eval-<name>-<mode>``), then
every arm of ``arms`` runs on it (:func:`fdsched.replay.runner.run_replay`); the shipped real traces of
``shipped`` run too (they were tuned on: reported, not held out).

Only the replay needs the host; reading the windows does not (:func:`load_windows`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from fdsched.core.common import plural, text_table
from fdsched.replay.armcompare import compare_arms, format_comparison
from fdsched.replay.figures import compute_figures
from fdsched.replay.report import format_value, ratio
from fdsched.replay.verdict import VERDICT_KEYS, verdict, verdict_lines
from fdsched.replay.trace import TraceError

__all__ = [
    "WINDOWS_FILE", "EvalWindow", "EvalPlan", "load_windows", "window_trace_name", "EVAL_COLUMNS", "eval_rows",
    "format_eval_table", "format_eval_markdown", "missing_csv_message", "plan_trace_names", "load_results",
    "load_arm_results",
]

WINDOWS_FILE = Path(__file__).with_name("windows.yaml")
MAX_TOKENS_MODES = ("unset", "true")

# (figure key, column header) of the one table.
EVAL_COLUMNS = (
    ("ttft_ms_p50", "TTFT p50"),
    ("e2e_ms_p99", "E2E p99"),
    ("tpot_ms_p99", "TPOT p99"),
    ("stall_ms_p99", "stall p99"),
    ("stall_ms_max", "stall max"),
    ("throughput_tokens_per_s", "thr"),
    ("preemptions", "preempt"),
    ("preemptions_prefill_victims", "prefill vict"),
)


@dataclass(frozen=True)
class EvalWindow:
    name: str
    source: str
    file: str
    fmt: str
    sha256: Optional[str]
    get: str
    start: float
    duration: Optional[float]
    rate_scale: float
    engine: dict
    max_tokens: tuple


@dataclass(frozen=True)
class EvalPlan:
    windows: tuple  # EvalWindow
    arms: tuple
    shipped: tuple
    tuning: tuple  # plain dicts


def _need(mapping, key, where):
    if not isinstance(mapping, dict) or key not in mapping:
        raise TraceError(f"{where}: missing key {key!r}")
    return mapping[key]


def load_windows(path: Optional[Path] = None) -> EvalPlan:
    """The split (raises TraceError naming the key on a bad file)."""
    import yaml

    path = Path(path) if path is not None else WINDOWS_FILE
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise TraceError(f"{path}: cannot be read as YAML ({exc}); allowed: a windows file like {WINDOWS_FILE.name}") from None
    sources = _need(data, "sources", str(path))
    windows = []
    for i, w in enumerate(_need(data, "evaluation", str(path)) or []):
        where = f"{path}: evaluation[{i}]"
        source = _need(w, "source", where)
        if source not in sources:
            raise TraceError(f"{where}: source {source!r} is not under sources; allowed: {', '.join(sources)}")
        src = sources[source]
        modes = tuple(str(m).lower() for m in w.get("max_tokens", ["unset"]))
        bad = [m for m in modes if m not in MAX_TOKENS_MODES]
        if bad:
            raise TraceError(f"{where}: max_tokens {bad[0]!r}; allowed: {', '.join(MAX_TOKENS_MODES)}")
        windows.append(EvalWindow(
            name=str(_need(w, "name", where)), source=source, file=str(_need(src, "file", f"{path}: sources.{source}")),
            fmt=str(_need(src, "format", f"{path}: sources.{source}")), sha256=src.get("sha256"), get=str(src.get("get", "")),
            start=float(w.get("start", 0.0)), duration=None if w.get("duration") is None else float(w["duration"]),
            rate_scale=float(w.get("rate_scale", 1.0)), engine=dict(_need(w, "engine", where)), max_tokens=modes,
        ))
    return EvalPlan(tuple(windows), tuple(data.get("arms") or ()), tuple(data.get("shipped") or ()),
                    tuple(data.get("tuning") or ()))


def window_trace_name(window: EvalWindow, mode: str) -> str:
    return f"{window.name}-{mode}"


def missing_csv_message(window: EvalWindow, csv_dir: Path) -> str:
    return (
        f"evaluation window {window.name}: {csv_dir / window.file} not found; get it with: {window.get}, then pass "
        f"--csv-dir with the folder that holds {window.file} (the plugin ships no large data file)"
    )


def import_window(window: EvalWindow, mode: str, csv_dir: Path, out_dir: Path) -> Path:
    """Import one evaluation window (raises TraceError: the CSV is missing or is not the one the split names)."""
    from fdsched.replay.importer import ImportOptions, import_trace

    csv = Path(csv_dir) / window.file
    if not csv.is_file():
        raise TraceError(missing_csv_message(window, Path(csv_dir)))
    if window.sha256:
        digest = hashlib.sha256(csv.read_bytes()).hexdigest()
        if digest != window.sha256:
            raise TraceError(
                f"evaluation window {window.name}: {csv} has sha256 {digest}; allowed: the file the split names "
                f"({window.sha256}; {window.get})"
            )
    out = Path(out_dir) / f"{window_trace_name(window, mode)}.jsonl"
    description = (
        f"Held-out evaluation window {window.name} (docs/evaluation.md): {window.file} from {window.start:g} s for "
        f"{window.duration:g} s, time compressed {window.rate_scale:g}x, clients' max_tokens {mode}. Source: "
        f"github.com/Azure/AzurePublicDataset, licensed CC-BY-4.0; cite Patel et al., Splitwise, ISCA 2024. Re-create: "
        f"fdsched trace import {window.file} --format {window.fmt} --start {window.start:g} --duration "
        f"{window.duration:g} --rate-scale {window.rate_scale:g} --max-tokens {mode} "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in window.engine.items())
    )
    options = ImportOptions(
        fmt=window.fmt, start_s=window.start, duration_s=window.duration, rate_scale=window.rate_scale,
        max_tokens=mode, engine=dict(window.engine), description=description,
    )
    import_trace(csv, out, options)
    return out


def eval_rows(results: Sequence[tuple]) -> list:
    """``results``: (trace name, [report profile entries]) -> table rows, one per arm; the first arm of each
    trace is the verdict's reference; throughput also as a ratio to the oracle and unbounded arms."""
    rows = []
    for trace_name, profiles in results:
        by_name = {p["profile"]: p["figures"] for p in profiles}
        ref = profiles[0]["figures"]
        for p in profiles:
            f = p["figures"]
            cells = [trace_name, p["profile"]] + [format_value(f.get(k)) for k, _ in EVAL_COLUMNS]
            for bound in ("oracle", "unbounded"):
                r = ratio(f.get("throughput_tokens_per_s"), by_name.get(bound, {}).get("throughput_tokens_per_s"))
                cells.append("-" if r is None else f"{r:.2f}")
            word = "ref" if p is profiles[0] else verdict(f, ref)[0]
            cells.append(word)
            cells.append("" if f.get("invariant_violations", 0) == 0 else f"{f['invariant_violations']} VIOLATIONS")
            rows.append(cells)
    return rows


def format_eval_table(results: Sequence[tuple]) -> str:
    headers = ["trace", "arm"] + [h for _, h in EVAL_COLUMNS] + ["thr/oracle", "thr/unbounded", "verdict", ""]
    note = (
        "modelled ms; thr = output tokens per modelled s; stall = a request's longest gap between two tokens; "
        f"verdict vs the trace's first arm on {', '.join(VERDICT_KEYS)} read together (docs/evaluation.md)"
    )
    lines = [line for trace_name, profiles in results for line in verdict_lines(profiles, what=trace_name)]
    return text_table(eval_rows(results), headers, align_right_from=2) + "\n" + note + (
        "\n\n" + "\n".join(lines) if lines else "")


def format_eval_markdown(results: Sequence[tuple]) -> str:
    """The same rows as :func:`format_eval_table` as a Markdown table (the trace named once per group)."""
    headers = ["trace", "arm"] + [h for _, h in EVAL_COLUMNS] + ["thr / oracle", "thr / unbounded", "verdict vs ref", ""]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    previous = None
    for cells in eval_rows(results):
        cells = list(cells)
        if cells[0] == previous:
            cells[0] = ""
        else:
            previous = cells[0]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plan_trace_names(plan: EvalPlan, include_shipped: bool = True) -> list:
    """Every trace the plan runs, in its order."""
    names = [window_trace_name(w, mode) for w in plan.windows for mode in w.max_tokens]
    return names + (list(plan.shipped) if include_shipped else [])


def _check_only(plan: EvalPlan, only, include_shipped: bool) -> Optional[set]:
    if not only:
        return None
    allowed = plan_trace_names(plan, include_shipped)
    bad = [name for name in only if name not in allowed]
    if bad:
        raise TraceError(f"--only: bad value {bad[0]!r} (not a trace of the split); allowed: {', '.join(allowed)}")
    return set(only)


def _eval_reports(dirs: Sequence, flag: str):
    """``(directory, path, trace name, parsed report)`` for every ``<trace>.report.json`` in ``dirs``, in order.
    Raises TraceError naming ``flag`` when a directory has none or a file is not JSON."""
    import json

    for d in dirs:
        reports = sorted(Path(d).glob("*.report.json")) if Path(d).is_dir() else []
        if not reports:
            raise TraceError(f"{flag}: bad value {str(d)!r} (no <trace>.report.json in it); allowed: an "
                             "--out directory of fdsched eval")
        for path in reports:
            try:
                report = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TraceError(_not_a_report(flag, path, exc)) from None
            yield d, path, path.name[: -len(".report.json")], report


def _not_a_report(flag: str, path, exc) -> str:
    return f"{flag}: {path}: not a report.json of fdsched eval ({exc})"


def _in_plan_order(found, order: Sequence[str], wanted: Optional[set]) -> list:
    """The trace names of ``found``: the plan's first, in its order, then the others sorted; only ``wanted``."""
    names = [n for n in order if n in found] + sorted(n for n in found if n not in order)
    return names if wanted is None else [n for n in names if n in wanted]


def load_results(dirs: Sequence, plan: Optional[EvalPlan] = None, only=None) -> tuple:
    """``(results, cost models, hosts)`` from the ``<trace>.report.json`` files earlier ``fdsched eval`` runs wrote
    to ``dirs`` (a later directory's report of a trace replaces an earlier one's), in the plan's trace order; the
    cost-model names and host commits found. Raises TraceError when a directory has no report or a report is
    unreadable."""
    plan = plan or load_windows()
    order = plan_trace_names(plan)
    wanted = _check_only(plan, only, True)
    found = {}
    for _, path, name, report in _eval_reports(dirs, "--table-from"):
        try:
            profiles = [{"profile": p["profile"], "figures": p["figures"], "cost_model": p.get("cost_model") or {}}
                        for p in report["profiles"]]
        except (KeyError, TypeError) as exc:
            raise TraceError(_not_a_report("--table-from", path, exc)) from None
        found[name] = (profiles, report.get("host") or {})
    names = _in_plan_order(found, order, wanted)
    results = [(n, [{"profile": p["profile"], "figures": p["figures"]} for p in found[n][0]]) for n in names]
    models = sorted({str(p["cost_model"].get("model") or p["cost_model"].get("name") or "?") for n in names for p in found[n][0]})
    hosts = sorted({str(found[n][1].get("commit") or found[n][1].get("label") or "?") for n in names})
    return results, models, hosts


DEFAULT_CHECK_EVERY = 32  # block invariants every 32 steps and at the end (the tests check every step)


def run_plan(plan: EvalPlan, csv_dir: Path, out_dir: Path, arms: Sequence[str], include_shipped: bool = True,
             progress_factory=None, log=print, check_every: int = DEFAULT_CHECK_EVERY,
             cost_overrides: Optional[dict] = None, only=None) -> list:
    """Import and replay; returns [(trace name, report profile entries)] and writes one report.json per trace.
    ``only``: run just these traces of the plan (names as :func:`plan_trace_names`; TraceError otherwise)."""
    from fdsched.replay.report import trace_info
    from fdsched.replay.report import build_report, report_json
    from fdsched.replay.runner import run_replay
    from fdsched.replay.tracefile import load_trace, resolve_trace, shipped_traces

    wanted = _check_only(plan, only, include_shipped)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    traces = []
    shipped = shipped_traces()
    for window in plan.windows:
        for mode in window.max_tokens:
            name = window_trace_name(window, mode)
            if wanted is not None and name not in wanted:
                continue
            if name in shipped:
                traces.append((name, shipped[name]))
            else:
                traces.append((name, import_window(window, mode, csv_dir, out_dir)))
    if include_shipped:
        traces += [(name, resolve_trace(name)) for name in plan.shipped if wanted is None or name in wanted]
    results = []
    for name, path in traces:
        trace = load_trace(path)
        engine = trace.engine_with()
        log(f"eval: {name}: {plural(len(trace.requests), 'request')}, arms {', '.join(arms)}")
        runs = []
        for arm in arms:
            started = time.perf_counter()
            runs += run_replay(trace, [arm], engine, cost_overrides, progress_factory=progress_factory,
                               check_every=check_every)
            log(f"eval: {name}: {arm} done in {time.perf_counter() - started:.0f} s")
        report = build_report(trace_info(trace, path), engine, runs, include_series=False)
        (out_dir / f"{name}.report.json").write_text(report_json(report), encoding="utf-8")
        results.append((name, [{"profile": p["profile"], "figures": p["figures"]} for p in report["profiles"]]))
    return results


def load_arm_results(dirs: Sequence, only=None) -> list:
    """Like :func:`load_results`, but merged per (trace, arm): a later directory's run of an arm on a trace replaces
    an earlier one's, the other arms stay (so an arm re-run alone joins the earlier runs of the rest). Returns
    ``[(trace, [{"profile", "figures", "host", "cost_model", "dir"}])]`` in the plan's trace order. Raises
    TraceError as :func:`load_results` does, and when one trace's arms ran under different cost models."""
    plan = load_windows()
    order = plan_trace_names(plan)
    wanted = _check_only(plan, only, True)
    found: dict = {}
    for d, path, name, report in _eval_reports(dirs, "--compare"):
        try:
            host = report.get("host") or {}
            for p in report["profiles"]:
                model = p.get("cost_model") or {}
                found.setdefault(name, {})[p["profile"]] = {
                    "profile": p["profile"], "figures": p["figures"], "dir": str(d),
                    "host": str(host.get("commit") or host.get("label") or "?"),
                    "cost_model": str(model.get("model") or model.get("name") or "?"),
                }
        except (KeyError, TypeError, AttributeError) as exc:
            raise TraceError(_not_a_report("--compare", path, exc)) from None
    names = _in_plan_order(found, order, wanted)
    results = []
    for name in names:
        arms = list(found[name].values())
        models = sorted({a["cost_model"] for a in arms})
        if len(models) > 1:
            raise TraceError(f"--compare: trace {name}: arms ran under different cost models ({', '.join(models)}); "
                             "allowed: one cost model per trace (pass the directories of one cost model)")
        results.append((name, arms))
    return results


def main(argv=None) -> int:
    """``python -m fdsched.replay.evaluate --compare DIR [DIR ...] [--only TRACE ...] [--markdown]``: the arm
    comparison (:func:`compare_arms`) of earlier ``fdsched eval`` runs; no host needed, nothing runs."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m fdsched.replay.evaluate", description=main.__doc__)
    parser.add_argument("--compare", nargs="+", required=True, metavar="DIR",
                        help="--out directories of fdsched eval (merged per trace and arm; a later one wins)")
    parser.add_argument("--only", nargs="+", metavar="TRACE", help="only these traces of the split")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    try:
        results = load_arm_results(args.compare, only=args.only)
    except TraceError as exc:
        print(f"python -m fdsched.replay.evaluate: {exc}", file=sys.stderr)
        return 1
    hosts = sorted({a["host"][:9] for _, arms in results for a in arms})
    models = sorted({a["cost_model"] for _, arms in results for a in arms})
    print(f"cost model(s): {', '.join(models)}; host commit(s): {', '.join(hosts)}")
    print(format_comparison(compare_arms(results), markdown=args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
