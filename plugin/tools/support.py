"""``fdsched host support``: where each FastDeploy line stands, from what the probe decides on it.

One row per host: its line, its commit, what CI runs on it, and per change what the plugin does there with no
profile named (every switch ``auto``): ``applied`` (the plugin's version runs), ``in host`` (the host already has
the change; the plugin leaves it) or ``declined`` (with the one line that says why), plus the shipped profiles
the host refuses at load (one line each, nothing patched). CI writes one row per host it sets up (``--json``)
and then checks that README.md and docs/host.md carry exactly the tables those rows make (``--check``), so the
support table is what CI ran, not what someone remembers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from fdsched.core.common import EXIT_ERROR, EXIT_OK

__all__ = ["support_row", "refused_row", "summary_table", "detail_table", "add_command"]

STATES = {"applied": "applied", "host": "in host", "skipped": "declined"}
MARKERS = {
    "summary": ("<!-- support-table:start -->", "<!-- support-table:end -->"),
    "detail": ("<!-- support-detail:start -->", "<!-- support-detail:end -->"),
}


def support_row(info) -> dict:
    """The row of a probed host (:class:`fdsched.install.probe.HostInfo`)."""
    from fdsched.core.settings import CHANGE_IDS
    from fdsched.core.settings import load_settings
    from fdsched.install.hosts import known_host
    from fdsched.install.installer import decide
    from fdsched.tools.hostsuite_cli import most_applying_profile, profile_decisions

    known = known_host(info.commit)
    decisions = decide(load_settings({}), info)
    changes = {}
    for change_id in CHANGE_IDS:
        d = decisions[change_id]
        reason = d.detail[len("skipped because "):] if d.state == "skipped" else ""
        changes[change_id] = {"state": STATES.get(d.state, d.state), "why": reason}
    refusals = {}
    by_profile = profile_decisions(info, refusals)
    refused = sorted(name for name, decided in by_profile.items() if decided is None)
    return {
        "line": known.line if known else "?",
        "commit": info.commit or "?",
        "tier": known.tier if known else "unknown",
        "changes": changes,
        "refused_profiles": refused,
        "refusals": {name: refusals[name] for name in refused},  # each refused profile's one-line reason
        "most_applying_profile": most_applying_profile(decisions=by_profile),
    }


def _is_support_row(path) -> bool:
    """Whether ``path`` holds a row this command wrote (a JSON object with a line, a commit and a tier)."""
    try:
        row = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(row, dict) and {"line", "commit", "tier"} <= set(row)


def refused_row(line: str, commit: str, why: str) -> dict:
    """The row of a host ``fdsched host setup`` refuses (no V1 scheduler)."""
    return {"line": line, "commit": commit, "tier": "refused", "refused": why}


_ORDER = {"2.0": 0, "2.2": 2, "2.3": 3, "2.4": 4, "2.5": 5, "2.6": 6, "develop": 9}


def _sorted(rows: list) -> list:
    """By line, then in the order fdsched.install.hosts lists the commits (old, new, head), unknown ones last."""
    from fdsched.install.hosts import KNOWN_HOSTS

    known = list(KNOWN_HOSTS)
    return sorted(rows, key=lambda r: (_ORDER.get(r["line"], 8), known.index(r["commit"]) if r["commit"] in known
                                       else len(known), r["commit"]))


def summary_table(rows: list) -> str:
    """README's table: line, commit, what CI runs, how many upstream changes and host fixes apply with no profile,
    refused profiles."""
    from fdsched.core.settings import HOST_FIXES, UPSTREAM_CHANGE_IDS

    lines = ["| FastDeploy line | commit | CI | upstream changes the plugin applies (all `auto`) | host fixes applied (of "
             "those the line needs) | shipped profiles refused |",
             "|---|---|---|---|---|---|"]
    for r in _sorted(rows):
        if r["tier"] == "refused":
            lines.append(f"| {r['line']} | `{r['commit'][:7]}` | set-up refuses | none: {r['refused']} | none | all |")
            continue
        applied = [c for c in UPSTREAM_CHANGE_IDS if _state(r, c) == "applied"]
        present = [c for c in UPSTREAM_CHANGE_IDS if _state(r, c) == "in host"]
        what = f"{len(applied)} of {len(UPSTREAM_CHANGE_IDS)}" + (f" (+{len(present)} in the host)" if present else "")
        fixed = [c for c in HOST_FIXES if _state(r, c) == "applied"]
        unneeded = [c for c in HOST_FIXES if _state(r, c) == "in host"]  # the line does not have the defect
        fixes = f"{len(fixed)} of {len(HOST_FIXES) - len(unneeded)}" + (f" ({len(unneeded)} not needed)" if unneeded
                                                                         else "")
        tier = {"full": "unit, host, engine tiers", "compat": "compatibility tier"}.get(r["tier"], r["tier"])
        refused = ", ".join(r["refused_profiles"]) or "none"
        lines.append(f"| {r['line']} | `{r['commit'][:7]}` | {tier} | {what} | {fixes} | {refused} |")
    return "\n".join(lines)


def _state(row: dict, change_id: str) -> str:
    """A row's state for a change; ``not probed`` in a row written before the change existed."""
    return row["changes"].get(change_id, {}).get("state", "not probed")


def detail_table(rows: list) -> str:
    """docs/host.md's table: change x line (applied / in host / declined; a host fix the line does not need: not
    needed), then why each decline."""
    from fdsched.core.settings import CHANGE_IDS, HOST_FIXES

    live = [r for r in _sorted(rows) if r["tier"] != "refused"]
    head = "| change | " + " | ".join(f"{r['line']} `{r['commit'][:7]}`" for r in live) + " |"
    lines = [head, "|---|" + "---|" * len(live)]
    notes = []
    for change_id in CHANGE_IDS:
        cells = []
        for r in live:
            cell = r["changes"].get(change_id, {"state": "not probed"})
            if cell["state"] == "declined":
                notes.append(f"- {change_id} on {r['line']} `{r['commit'][:7]}`: {cell['why']}")
                cells.append(f"declined ({len(notes)})")
            elif change_id in HOST_FIXES and cell["state"] == "in host":
                cells.append("not needed")  # the line does not have the defect
            else:
                cells.append(cell["state"])
        lines.append(f"| {change_id} | " + " | ".join(cells) + " |")
    lines.append("| shipped profiles refused at load | " + " | ".join(", ".join(r["refused_profiles"]) or "none"
                                                                    for r in live) + " |")
    refused = [r for r in _sorted(rows) if r["tier"] == "refused"]
    text = "\n".join(lines)
    if notes:
        text += "\n\nDeclined, in the plugin's own words:\n\n" + "\n".join(
            f"{i}. {note[2:]}" for i, note in enumerate(notes, 1))
    for r in refused:
        text += f"\n\n{r['line']} `{r['commit'][:7]}`: `fdsched host setup` refuses it: {r['refused']}."
    return text


def _block(text: str, kind: str) -> Optional[str]:
    start, end = MARKERS[kind]
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def add_command(host_sub) -> None:
    p = host_sub.add_parser("support", help="where this host stands: per change applied / in host / declined")
    p.add_argument("--json", metavar="PATH", help="also write this host's row as JSON (CI collects one per host)")
    p.add_argument("--refused", nargs=3, metavar=("LINE", "COMMIT", "WHY"),
                   help="write (with --json) the row of a host that set-up refuses instead of probing one")
    p.add_argument("--rows", nargs="+", metavar="JSON", help="print the tables these rows make (no probe)")
    p.add_argument("--check", nargs="+", metavar="FILE",
                   help="with --rows: fail unless each file's marked table is exactly the generated one")
    p.set_defaults(func=cmd_support)


def cmd_support(args) -> int:
    if args.rows:
        rows = [json.loads(Path(path).read_text(encoding="utf-8")) for path in args.rows]
        tables = {"summary": summary_table(rows), "detail": detail_table(rows)}
        if not args.check:
            print(tables["summary"] + "\n\n" + tables["detail"])
            return EXIT_OK
        failed = False
        for path in args.check:
            text = Path(path).read_text(encoding="utf-8")
            found_any = False
            for kind, table in tables.items():
                block = _block(text, kind)
                if block is None:
                    continue
                found_any = True
                if block != table.strip():
                    failed = True
                    print(f"fdsched host support: {path}: the {kind} table differs from what CI ran; replace the "
                          f"block between {MARKERS[kind][0]} and {MARKERS[kind][1]} with:\n{table}", file=sys.stderr)
            if not found_any:
                failed = True
                print(f"fdsched host support: {path} has no support table markers", file=sys.stderr)
        if not failed:
            print(f"support tables in {', '.join(args.check)} match the {len(rows)} hosts CI ran")
        return EXIT_ERROR if failed else EXIT_OK
    if args.json:
        from fdsched.cmdline.outdir import OutputError, check_out_file

        try:  # before the probe: never over a file this command did not write
            check_out_file(args.json, "fdsched host support", _is_support_row, flag="--json")
        except OutputError as exc:
            print(f"fdsched host support: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
    if args.refused:
        row = refused_row(*args.refused)
    else:
        from fdsched.install.probe import probe
        from fdsched.cmdline.quiet import host_output_to
        from fdsched.install.hosts import cache_dir

        with host_output_to(cache_dir() / "logs" / "support-host.log", verbose=False):
            info = probe()
        row = support_row(info)
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1, sort_keys=True), encoding="utf-8")
    print(summary_table([row]))
    return EXIT_OK
