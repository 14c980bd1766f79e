"""``fdsched explain``: which classes run on this host, for one arm.

For each host class the plugin replaces (a *target*: ``ResourceManagerV1``, ``PrefixCacheManager``,
``EngineCacheQueue``) it shows the fixed class's chain (the method resolution order) down to the host class, every
host method or attribute the chain overrides with the classes that define it in the order they run, the layers each
seam hands a call through for the arm (its strategies, outermost first, then the host's own method), and, per change,
the table's row: the arm's decision, the strategy it gets on this host and which of the change's host methods it
serves. Nothing is re-derived: the classes and the table are the installer's own
(:func:`fdsched.install.installer._build`, :func:`fdsched.install.installer.strategy_row`), built without rebinding
anything.

The collection (:func:`explain_class`) and the formatting (:func:`format_explanation`) work on plain classes
and values; only :func:`explain_host` needs the host. ``docs/explain.md`` is this command's output for the
shipped hosts and profiles (``python -m fdsched.tools.explain --write-docs docs/explain.md``, once per host);
a host test regenerates the section of the host it runs on and compares.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

__all__ = [
    "ChangeRow",
    "TargetExplanation",
    "explain_class",
    "format_explanation",
    "explain_host",
    "docs_section",
    "add_command",
]

# Class attributes every class has, or that the installer sets as data: not overrides of the host's code.
_NOT_OVERRIDES = frozenset({
    "__module__", "__doc__", "__qualname__", "__dict__", "__weakref__", "__annotations__", "__firstlineno__",
    "__static_attributes__", "__slots__", "__parameters__", "__orig_bases__", "__init_subclass__",
})


@dataclass(frozen=True)
class ChangeRow:
    """One change on one target: its decision for the arm, the strategy it gets there (None: the host's own code
    runs), and per host method it names (``replaces``), what implements it for this arm (None: the host's own)."""

    change_id: str
    impl: str
    detail: str
    strategy: Optional[str]
    methods: tuple  # ((method, implementing class name or None), ...)


@dataclass
class TargetExplanation:
    target: str
    host_class: str  # the host class's dotted path
    chain: list  # [(class name, role)] outermost first, down to the host class
    host_bases: list  # the host class's own bases below it (names)
    overrides: list  # [(method, [class names that define it, in the order they run])]
    changes: list = field(default_factory=list)  # [ChangeRow]
    note: str = ""  # e.g. why the queue class runs a change this arm does not
    steps: list = field(default_factory=list)  # [(step kind, ["module.Class.method", ...])]: schedule()'s steps
    layers: list = field(default_factory=list)  # [(seam, ["module.Class", ..., "host"])]: outermost first


def class_name(cls: type) -> str:
    """A class as the page shows it: ``module.Qualname``, a strategy as ``<patch module>.Qualname`` (in
    ``patches/``), the installer's classes by their plain name (the arm's with its label)."""
    if cls.__module__ == "fdsched.install.installer":
        return cls.__qualname__.split("<locals>.", 1)[-1]
    if cls.__module__.startswith("fdsched.patches."):  # the patch module and the class: patches/<module>.py
        return f"{cls.__module__[len('fdsched.patches.'):]}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _role(cls: type, fixed: type, host_cls: type) -> str:
    if cls is fixed:
        return "the plugin's class (the host module's name is rebound to it; every arm constructs it)"
    if cls is host_cls:
        return "the host's class"
    if cls.__module__.startswith("fdsched.patches."):
        module = cls.__module__[len("fdsched.patches."):].split(".", 1)[0]
        return {"_guard": "the scheduler guard (every arm)",
                "_cache_queue": "the cache queue's seams (each hands the call to a strategy)",
                "_prefix_cache": "the prefix cache's seams (each hands the call to its strategies)",
                "_scheduler": "the scheduler's seams (each hands the call to its strategies) and its one schedule(): "
                              "the pass's plan, each change's steps"}.get(module, "plugin base")
    return ""


def _defines(cls: type, name: str) -> bool:
    return name in vars(cls)


def explain_class(target: str, fixed: type, host_cls: type, change_strategies: Sequence[tuple],
                  replaces: dict) -> TargetExplanation:
    """Explain one arm on one target's fixed class.

    ``change_strategies``: per change in catalogue order, ``(change_id, impl, detail, strategy class or None)`` (the
    table's row for the arm); ``replaces``: change id -> the names of the target's host methods the change may serve.
    Works on any class whose MRO contains ``host_cls``."""
    mro = fixed.__mro__
    cut = mro.index(host_cls)
    plugin_part = mro[:cut]
    chain = [(class_name(c), _role(c, fixed, host_cls)) for c in plugin_part]
    chain.append((f"{host_cls.__module__}.{host_cls.__qualname__}", _role(host_cls, fixed, host_cls)))
    host_bases = [c.__qualname__ if c is object else f"{c.__module__}.{c.__qualname__}" for c in mro[cut + 1:]]

    names = []
    for cls in plugin_part:
        for name in vars(cls):
            if name in _NOT_OVERRIDES or name.startswith("_fdsched") or name in names:
                continue
            if hasattr(host_cls, name):
                names.append(name)
    overrides = []
    for name in sorted(names):
        definers = [class_name(c) for c in plugin_part if _defines(c, name)]
        owner = next((c for c in mro[cut:] if _defines(c, name)), None)
        if owner is not None:
            definers.append(f"host: {owner.__qualname__}")
        overrides.append((name, definers))

    rows = []
    for change_id, impl, detail, strategy in change_strategies:
        methods = tuple((name, _served_by(name, strategy, plugin_part) if strategy is not None else None)
                        for name in replaces.get(change_id, ()))
        if impl == "host" and strategy is not None:
            detail = host_impl_detail(detail, strategy)
        rows.append(ChangeRow(change_id, impl, detail, None if strategy is None else class_name(strategy), methods))
    outermost = tuple(getattr(fixed, "_fdsched_outermost", ()))
    strategies = [s for *_, s in change_strategies if s is not None]
    return TargetExplanation(target, f"{host_cls.__module__}.{host_cls.__qualname__}", chain, host_bases, overrides,
                             rows, steps=_steps(fixed, strategies), layers=_layers(host_cls, outermost, strategies))


def _layers(host_cls: type, outermost: tuple, strategies: list) -> list:
    """Per host method some strategy serves: the strategies a call goes through, outermost first (``outermost``, then
    later catalogue entries first), ending in the host's own method."""
    order = list(outermost) + list(reversed(strategies))
    seams = sorted({name for s in order for name in getattr(s, "seams", ())})
    return [(name, [class_name(s) for s in order if name in s.seams] + [f"host: {host_cls.__qualname__}"])
            for name in seams]


def _served_by(name: str, strategy: type, plugin_part) -> Optional[str]:
    """Who implements host method ``name`` where a fixed class hands its seams to ``strategy``: the class that defines
    the seam, and the strategy where it serves that method (None where the host has no such method: no seam)."""
    from fdsched.patches._spec import served_methods

    seam = next((class_name(c) for c in plugin_part if _defines(c, name) and callable(vars(c)[name])), None)
    if seam is None:
        return None
    return f"{seam} -> {class_name(strategy)}" if name in served_methods(strategy) else seam


def _steps(fixed: type, strategies: list) -> list:
    """The steps of the scheduler's one ``schedule()``, per kind in the order they run (strategies in catalogue
    order); none for a class without it."""
    from fdsched.patches._scheduler import STEPS, Scheduler

    if Scheduler not in fixed.__mro__:
        return []
    return [(kind, [f"{class_name(s)}.{kind}" for s in strategies if hasattr(s, kind)]) for kind in STEPS]


def host_impl_detail(detail: str, strategy) -> str:
    """A change whose host code runs, while a strategy of it still serves host methods: what the plugin does there
    (the strategy's ``fdsched_host_role``), never only "host already has it"."""
    role = getattr(strategy, "fdsched_host_role", "runs its code around the host's in the methods below")
    if detail == HOST_HAS_IT:
        return f"the host's own version runs (the host has the change); the plugin only {role}"
    return f"{detail}; the plugin only {role}"


NOT_OVERRIDDEN = "not overridden by this change"
HOST_HAS_IT = "host already has it"  # the installer's decision text for impl "host" on a host that has the change
TEXT_WIDTH = 100  # the text output's lines, where a chain allows (a class name is never split)


def _wrap_chain(head: str, items: Sequence[str], width: int = TEXT_WIDTH) -> list:
    """``head`` then ``a -> b -> c``, broken before an arrow when a line would pass ``width``."""
    lines, line = [], head + items[0]
    for item in items[1:]:
        if len(line) + 4 + len(item) > width:
            lines.append(line)
            line = " " * (len(head) + 2) + "-> " + item
        else:
            line += " -> " + item
    return lines + [line]


def format_explanation(title: str, targets: Sequence[TargetExplanation], markdown: bool = False) -> str:
    """The explanation as text (or Markdown for the docs page): per target the chain, the overridden methods in
    the order their definitions run, each seam's layers, and per change its strategy and methods."""
    out = [f"### {title}" if markdown else title]
    for t in targets:
        out.append("")
        out += _markdown_target(t) if markdown else _text_target(t)
        if t.note:
            out.append("")
            out.append(t.note)
    return "\n".join(out)


def _markdown_target(t: TargetExplanation) -> list:
    out = [f"#### {t.target}", "", f"Host class `{t.host_class}`. Class chain (MRO), outermost first:", ""]
    for i, (name, role) in enumerate(t.chain, start=1):
        out.append(f"{i}. `{name}`" + (f": {role}" if role else ""))
    out.append(f"{len(t.chain) + 1}. the host's own bases: " + ", ".join(f"`{b}`" for b in t.host_bases))
    out += ["", "Overridden host methods, definitions in the order they run:", ""]
    out += [f"- `{name}`: " + " -> ".join(f"`{d}`" for d in definers) for name, definers in t.overrides]
    if t.layers:
        out += ["", "Each seam's layers for this arm, outermost first:", ""]
        out += [f"- `{name}`: " + " -> ".join(f"`{d}`" for d in layers) for name, layers in t.layers]
    if t.steps:
        out += ["", "Steps of the one `schedule()`, in the order they run:", ""]
        out += [f"- `{kind}`: " + (" -> ".join(f"`{o}`" for o in owners) or "none") for kind, owners in t.steps]
    out += ["", "| change | decision | strategy | host method: implemented by |", "|---|---|---|---|"]
    for row in t.changes:
        methods = "; ".join(f"`{m}`: {('`' + c + '`') if c else NOT_OVERRIDDEN}" for m, c in row.methods)
        out.append(f"| {row.change_id} | {row.detail} | {('`' + row.strategy + '`') if row.strategy else '-'} | "
                   f"{methods or '-'} |")
    return out


def _text_target(t: TargetExplanation) -> list:
    out = [f"{t.target} ({t.host_class})", "  class chain (MRO), outermost first:"]
    for i, (name, role) in enumerate(t.chain, start=1):
        out.append(f"    {i:>2}. {name}" + (f"  [{role}]" if role else ""))
    out.append(f"    {len(t.chain) + 1:>2}. the host's own bases: " + ", ".join(t.host_bases))
    out.append("  overridden host methods (definitions in the order they run):")
    for name, definers in t.overrides:
        out += _wrap_chain(f"    {name}: ", definers)
    if t.layers:
        out.append("  each seam's layers for this arm (outermost first):")
        for name, layers in t.layers:
            out += _wrap_chain(f"    {name}: ", layers)
    if t.steps:
        out.append("  steps of the one schedule() (in the order they run):")
        for kind, owners in t.steps:
            out += _wrap_chain(f"    {kind}: ", owners or ["none"])
    out.append("  per change (decision; strategy; host method: implemented by):")
    for row in t.changes:
        out.append(f"    {row.change_id}: {row.detail}; strategy: {row.strategy or 'none'}")
        for m, c in row.methods:
            out.append(f"      {m}: {c or NOT_OVERRIDDEN}")
    return out


def _settings_for(profile: Optional[str], dp_rank: Optional[int]):
    """(settings, arm settings by rank, label) for the command: --profile alone, else the environment's
    profile and FDSCHED_PROFILE_BY_DP_RANK (the arm of --dp-rank)."""
    from fdsched.core.settings import load_arm_settings, load_settings, resolve_profile

    if profile is not None:
        resolve_profile(profile, "--profile")  # '' or a typo: one line naming the option
        return load_settings(environ={}, profile=profile), {}
    return load_settings(), load_arm_settings()


def explain_host(settings, arm_settings: dict, dp_rank: Optional[int] = None, info=None) -> tuple:
    """``(title, [TargetExplanation], arm label)`` for the arm that ``dp_rank`` runs (None: the single profile's) on the
    probed host: the installer decides every change and builds the classes, nothing is rebound. Raises
    HostNotFound, InstallError."""
    from fdsched.core.hooks import Policies, make_plugin_manager
    from fdsched.install import installer
    from fdsched.install.probe import probe
    from fdsched.patches import CATALOGUE

    info = info or probe()
    decisions = installer.decide(settings, info)
    arms = installer.decide_arms(arm_settings, info)
    policies = Policies(make_plugin_manager(environ={}, load_entry_points=False))
    classes = installer._build(info, settings, decisions, policies, arms)
    arm = arms.get(dp_rank) if dp_rank is not None else None
    arm = arm or installer.Arm(installer.arm_label(settings), settings, decisions)
    targets = []
    for target, front in classes.items():
        host_cls = info.host_classes[target]
        impl = arm.impl
        change_strategies, replaces = [], {}
        for spec in CATALOGUE:
            names = tuple(n.split(".", 1)[1] for n in spec.replaces if n.split(".", 1)[0] == target)
            strategy, _why_not = spec.choose(target, impl[spec.change_id], host_cls, bool(info.has.get(spec.change_id)),
                                          arm.settings, info.host_classes)  # the host's shape, as the installer picks
            if not names and strategy is None:
                continue
            replaces[spec.change_id] = names
            change_strategies.append((spec.change_id, impl[spec.change_id], arm.decisions[spec.change_id].detail,
                                      strategy))
        explanation = explain_class(target, front, host_cls, change_strategies, replaces)
        if (target == "EngineCacheQueue" and getattr(front, "_fdsched_serves_waiting", False)
                and impl["nonpolling_transfer"] != "plugin"):
            explanation.note = ("The queue (built without a rank: the engine's server, each cache manager's client) has "
                                "one class for every rank; its server's done lists can wait because another arm's "
                                "receiver does, and the client this arm's cache manager stores polls as the host does.")
        targets.append(explanation)
    if dp_rank is not None and dp_rank in arms:
        where = f"dp rank {dp_rank}"
    else:
        where = "the ranks without an arm of their own" if arms else "every rank"
    title = f"profile {arm.label} on {info.name} ({where})"
    return title, targets, arm.label


# ---- the docs page ------------------------------------------------------------------------------------
SECTION_START = "<!-- explain:{key} start -->"
SECTION_END = "<!-- explain:{key} end -->"


def section_key(info) -> str:
    """A host's name on the page: its key among the supported hosts (old, new), else its commit."""
    from fdsched.install.hosts import host_key

    return host_key(info.commit) or str(info.commit)


def docs_section(info=None) -> str:
    """The docs page's section for the probed host: one explanation per shipped profile (each with only its
    profile's settings, not the environment's), between markers naming the host (:func:`section_key`)."""
    from fdsched.core.settings import load_settings, shipped_profiles
    from fdsched.install.probe import probe

    info = info or probe()
    key = section_key(info)
    parts = [SECTION_START.format(key=key), "", f"## The {key} host", ""]
    for name in shipped_profiles():
        settings = load_settings(environ={}, profile=name)
        try:
            _, targets, label = explain_host(settings, {}, info=info)
        except Exception as exc:  # the host declines this profile: say so, as the command does
            parts += [f"### profile {name} on the {key} host", "", f"Refused here: {exc}", ""]
            continue
        parts += [format_explanation(f"profile {label} on the {key} host", targets, markdown=True), ""]
    parts.append(SECTION_END.format(key=key))
    return "\n".join(parts)


def replace_section(page: str, section: str, key: str) -> str:
    """``page`` with the section of host ``key`` replaced by ``section`` (appended when it has none)."""
    start, end = SECTION_START.format(key=key), SECTION_END.format(key=key)
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if pattern.search(page):
        return pattern.sub(lambda _: section, page)
    return page.rstrip("\n") + "\n\n" + section + "\n"


def read_section(page: str, key: str) -> Optional[str]:
    """The section of host ``key`` in ``page`` (markers included), or None."""
    start, end = SECTION_START.format(key=key), SECTION_END.format(key=key)
    match = re.search(re.escape(start) + ".*?" + re.escape(end), page, re.S)
    return match.group(0) if match else None


# ---- the command --------------------------------------------------------------------------------------
def cmd_explain(args) -> int:
    from fdsched.core.common import EXIT_ERROR, EXIT_NO_HOST, EXIT_OK, error_line
    from fdsched.core.settings import SettingsError
    from fdsched.install.installer import InstallError
    from fdsched.install.probe import HostNotFound
    from fdsched.tools.hostsetup import cache_dir
    from fdsched.cmdline.quiet import host_output_to, log_note

    if args.profile is not None and args.dp_rank is not None:
        print(error_line("explain", f"--dp-rank {args.dp_rank}: bad value with --profile (one profile runs on every "
                                    "rank); allowed: --profile P, or --dp-rank R with FDSCHED_PROFILE_BY_DP_RANK set"),
              file=sys.stderr)
        return EXIT_ERROR
    try:
        settings, arm_settings = _settings_for(args.profile, args.dp_rank)
    except SettingsError as exc:
        print(error_line("explain", exc), file=sys.stderr)
        return EXIT_ERROR
    if args.dp_rank is not None and args.profile is None and args.dp_rank not in arm_settings:
        ranks = ", ".join(str(r) for r in sorted(arm_settings)) or "none set"
        print(f"fdsched explain: note: dp rank {args.dp_rank} has no arm of its own in FDSCHED_PROFILE_BY_DP_RANK "
              f"(ranks: {ranks}); it runs the profile below", file=sys.stderr)
    log_path = cache_dir() / "logs" / "explain-host.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    error, result = None, None
    with host_output_to(log_path, verbose=args.verbose) as host_log:
        try:
            result = explain_host(settings, arm_settings, args.dp_rank)
        except (HostNotFound, InstallError) as exc:
            error = exc
        except Exception as exc:  # the host differs from what the installer builds on: one line, not a traceback
            error = RuntimeError(f"cannot build the classes on this host: {type(exc).__name__}: {exc}")
    if error is not None:
        print(error_line("explain", error), file=sys.stderr)
        return EXIT_NO_HOST if isinstance(error, HostNotFound) else EXIT_ERROR
    title, targets, _ = result
    print(format_explanation(title, targets, markdown=args.markdown))
    note = log_note(host_log)
    if note:
        print("\n" + note)
    return EXIT_OK


def add_command(sub) -> None:
    from fdsched.core.common import bounded_int

    p = sub.add_parser(
        "explain",
        help="the classes an arm runs on this host: class chain, overridden methods, each seam's strategies",
        description="For each host class the plugin replaces: the class chain the installer builds for the arm on "
        "this host, the host methods it overrides (definitions in the order they run) and, per change, which "
        "strategy serves each of its methods. Builds the classes; rebinds nothing.",
    )
    p.add_argument("--profile", metavar="P", help="a shipped profile name or a YAML path (default: the "
                   "environment's FDSCHED_PROFILE and variables, as the engine reads them)")
    p.add_argument("--dp-rank", type=bounded_int(0, 1023), metavar="R",
                   help="the arm of data-parallel rank R under FDSCHED_PROFILE_BY_DP_RANK (default: the single profile)")
    p.add_argument("--markdown", action="store_true", help="print Markdown (as docs/explain.md)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show the host's own import messages here instead of in a log file")
    p.set_defaults(func=cmd_explain)


def main(argv: Optional[list] = None) -> int:
    """``python -m fdsched.tools.explain --write-docs PAGE``: replace the probed host's section of PAGE."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fdsched.tools.explain")
    parser.add_argument("--write-docs", required=True, metavar="PAGE")
    args = parser.parse_args(argv)
    from fdsched.cmdline.quiet import host_output_to
    from fdsched.replay.engine import prepare_host_environment
    from fdsched.tools.hostsetup import cache_dir

    # As `fdsched explain` does: the host's ./log and /tmp/prom_main_* go to directories that leave with the process.
    prepare_host_environment()

    with host_output_to(cache_dir() / "logs" / "explain-host.log", verbose=False):  # the host's import chatter
        from fdsched.install.probe import probe

        info = probe()
        section = docs_section(info)
    page = Path(args.write_docs)
    key = section_key(info)
    page.write_text(replace_section(page.read_text(encoding="utf-8"), section, key), encoding="utf-8")
    print(f"{page}: section of the {key} host written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
