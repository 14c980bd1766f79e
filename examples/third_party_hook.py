"""A third-party preemption policy for fdsched (pluggy hook implementation).

Register it in your package's setup.cfg:

    [options.entry_points]
    fdsched.hooks =
        longest_first = my_package.policy

The plugin loads it when it installs (block it with FDSCHED_DISABLE_EXTERNAL_HOOKS=longest_first).
"""

import fdsched


@fdsched.hookimpl
def fdsched_select_preemption_victim(candidates, decode_only):
    """Among decoding requests without extend tables, preempt the one that arrived last but only if the
    queue has more than four; otherwise defer to the plugin's default (return None)."""
    if len(candidates) <= 4:
        return None
    for index in range(len(candidates) - 1, -1, -1):
        candidate = candidates[index]
        if candidate.decoding and not candidate.uses_extend_tables:
            return index
    return None
