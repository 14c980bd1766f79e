"""``fdsched serve``'s checks that need more than one flag's value: the flags that mean something only with
``--trace``, arms run in turn (``--arms A,B``: a trace, one rank, profiles that load), every data-parallel rank has
exactly one arm, and the engine shape passes the host's own config checks. All run before anything is spawned, one
line per problem; and the start-up banner's line of which profile each rank runs.
"""

from __future__ import annotations

import os
import re
from typing import Optional

__all__ = ["rank_arm_problems", "host_shape_problems", "rank_profiles", "profiles_line", "sequential_arms",
           "sequential_arms_problems", "trace_only_problems"]

# The host's names for the engine shape, and the serve flag that sets each (longest first: one name holds another)
HOST_NAMES = (
    ("num_gpu_blocks_override", "--num-gpu-blocks"),
    ("max_num_batched_tokens", "--max-num-batched-tokens"),
    ("max_model_len", "--max-model-len"),
    ("max_num_seqs", "--max-num-seqs"),
    ("block_size", "--block-size"),
    ("num_gpu_blocks", "--num-gpu-blocks"),
)


def rank_arm_problems(arms_text: Optional[str], dp: int, profile: Optional[str] = None) -> list:
    """``--arms RANK=PROFILE,...`` with ``--dp N``: every rank 0..N-1 needs an arm, or ``--profile`` for the ranks
    without one (else such a rank would run the default profile unannounced). Ranks beyond N and the syntax are
    checked by the launcher's check."""
    from fdsched.core.settings import SettingsError, parse_dp_arms

    if profile or not arms_text or "=" not in arms_text or not isinstance(dp, int) or dp < 2:
        return []
    try:
        arms = parse_dp_arms(arms_text, origin="--arms")
    except SettingsError:
        return []
    missing = [rank for rank in range(dp) if rank not in arms]
    if not missing:
        return []
    example = ",".join(f"{rank}=PROFILE" for rank in missing)
    return [f"--arms {arms_text!r} with --dp {dp}: rank {', '.join(map(str, missing))} has no arm; allowed: one "
            f"RANK=PROFILE per rank 0-{dp - 1} (add {example}), --profile P for the ranks without one, or --dp "
            f"{len(arms)} if fewer ranks were meant"]


def rank_profiles(profile: Optional[str], arms_text: Optional[str], dp: int) -> list:
    """Each rank's profile, in rank order: its ``--arms`` entry, else ``--profile``, else ``default``."""
    by_rank = {}
    for item in (arms_text or "").split(","):
        if "=" in item:
            rank, name = item.split("=", 1)
            if rank.strip().isdigit():
                by_rank[int(rank.strip())] = name.strip()
    return [by_rank.get(rank, profile or "default") for rank in range(max(1, dp))]


def profiles_line(profile: Optional[str], arms_text: Optional[str], dp: int) -> str:
    """The banner's line: ``profiles: rank 0 baseline, rank 1 recommended``."""
    names = rank_profiles(profile, arms_text, dp)
    return "profiles: " + ", ".join(f"rank {rank} {name}" for rank, name in enumerate(names))


def _in_flag_words(message: str) -> str:
    """The host's message with its setting names said as the serve flags that set them."""
    for name, flag in HOST_NAMES:
        message = re.sub(rf"\b{name}\b", flag, message)
    return message


def host_shape_problems(config) -> list:
    """The host's own config checks run on the served engine's shape (``fdsched.replay.engine.host_config``, the
    same host classes the engine builds), in this process: [] when it passes, else one line naming the flags."""
    from fdsched.replay.engine import EngineShape, host_config

    shape = EngineShape(block_size=config.block_size, num_gpu_blocks=config.num_gpu_blocks,
                        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                        max_model_len=config.max_model_len, enable_prefix_caching=config.enable_prefix_caching)
    saved = dict(os.environ)
    try:
        host_config(shape, replay_check=False)
    except Exception as exc:  # noqa: BLE001 - the host's own check: mostly an assert with its reason
        first = (str(exc).splitlines() or [""])[0].strip() or type(exc).__name__
        return [f"engine shape refused by FastDeploy's own config check: {_in_flag_words(first)}; allowed: a shape "
                "it accepts (change the flags it names)"]
    finally:  # the host's config classes write into the process environment on a CPU machine: not for the stack
        os.environ.clear()
        os.environ.update(saved)
    return []


def sequential_arms(args) -> list:
    """``--arms A,B`` (no ranks): the arms run one after another, each on the whole trace; [] otherwise."""
    if not args.arms or "=" in args.arms:
        return []
    return [a.strip() for a in args.arms.split(",")]


def trace_only_problems(args) -> list:
    """The flags that mean something only with --trace."""
    problems = []
    if args.time_schedule and not args.trace:
        problems.append("--time-schedule: allowed only with --trace")
    if getattr(args, "exact_max_tokens", False) and not args.trace:
        problems.append("--exact-max-tokens: allowed only with --trace (it changes what the trace's clients send)")
    if args.out and not args.trace:
        problems.append(f"--out {args.out}: allowed only with --trace (the report directory)")
    return problems


def sequential_arms_problems(args, arms) -> list:
    """``--arms A,B`` (run in turn): a trace, one rank, no --profile beside it, distinct profiles that load."""
    from fdsched.core.settings import SettingsError, resolve_profile

    if not arms:
        return []
    problems = []
    if not args.trace:
        problems.append(f"--arms {args.arms!r}: arms without ranks run in turn on a trace: add --trace, or give "
                        "one arm per rank (RANK=PROFILE, with --dp >= 2)")
    if args.dp != 1:
        problems.append(f"--arms {args.arms!r} with --dp {args.dp}: arms run in turn use one rank each; allowed: "
                        "--dp 1, or RANK=PROFILE items for one arm per rank")
    if args.profile:
        problems.append(f"--profile {args.profile} with --arms {args.arms!r}: allowed: one of them")
    if "" in arms or len(set(arms)) != len(arms):
        problems.append(f"--arms {args.arms!r}: allowed: distinct profile names or paths, comma-separated")
    for arm in arms:
        if arm:
            try:
                resolve_profile(arm, "--arms")
            except SettingsError as exc:
                problems.append(str(exc))
    return problems
