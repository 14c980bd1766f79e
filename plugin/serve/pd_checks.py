"""The PD stack's checks against the host, before anything is spawned: what seam S12 stands in for (the host calls,
with their parameters) and whether each role's profile passes the plugin's own installer decisions on this host.
One line per problem."""

from __future__ import annotations

import os

from fdsched.serve.pd import PdConfig, instance_profiles

__all__ = ["host_pd_problems", "pd_seam_problems", "PD_HOST_CALLS"]


def host_pd_problems(c: PdConfig) -> list:
    """What the host must have for the PD stack, and whether it takes each instance's profile (the plugin's own
    installer decisions, run here as the engine will run them): one line each. Needs the host importable."""
    problems = []
    try:
        from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager
        from fastdeploy.inter_communicator import EngineWorkerQueue
        from fastdeploy.router.router import RouterArgs
        from fastdeploy.splitwise.splitwise_connector import SplitwiseConnector
    except Exception as exc:  # noqa: BLE001 - the host line lacks the PD modules
        return [f"--prefill/--decode: this host has no PD stack ({type(exc).__name__}: {exc}); allowed: a host with "
                "fastdeploy.router and fastdeploy.splitwise, or the mixed stack (no --prefill/--decode)"]
    problems += pd_seam_problems(PrefixCacheManager, EngineWorkerQueue, RouterArgs, SplitwiseConnector)
    problems += _profile_refusals(c)
    return problems


# What the simulated messager and worker stand in for, checked against the host before start (S12): the host
# method, and the parameters it must take (after self) for the calls the host and the simulation make.
PD_HOST_CALLS = (
    ("PrefixCacheManager.launch_cache_messager", ("cache_config", "tensor_parallel_size", "device_ids",
                                                  "key_cache_shape", "value_cache_shape", "pod_ip",
                                                  "engine_worker_queue_port", "ipc_suffix")),
    ("EngineWorkerQueue.get_cache_info", ()),
    ("EngineWorkerQueue.put_finished_req", ("send_cache_result",)),
    ("EngineWorkerQueue.get_finished_req", ()),
    ("SplitwiseConnector.send_cache_info_to_messager", ("tasks", "current_id")),
    ("SplitwiseConnector.send_cache_info_to_prefill", ("tasks",)),
)


def pd_seam_problems(prefix_cache_manager, engine_worker_queue, router_args, connector) -> list:
    """One line per host call the PD seams rely on that is missing or takes other parameters."""
    import inspect

    classes = {"PrefixCacheManager": prefix_cache_manager, "EngineWorkerQueue": engine_worker_queue,
               "SplitwiseConnector": connector}
    problems = []
    for target, params in PD_HOST_CALLS:
        cls_name, method = target.split(".")
        fn = getattr(classes[cls_name], method, None)
        if fn is None:
            problems.append(f"the host has no {target}, which the simulated cache messager stands in for (seam S12)")
            continue
        got = tuple(inspect.signature(fn).parameters)[1:]
        if got != params:
            problems.append(f"the host's {target} takes ({', '.join(got)}), the simulation expects "
                            f"({', '.join(params)}) (seam S12)")
    if "splitwise" not in getattr(router_args, "__dataclass_fields__", {}):
        problems.append("the host's Router has no splitwise mode (RouterArgs.splitwise)")
    return problems


def _profile_refusals(c: PdConfig) -> list:
    """Each role's profile through the plugin's installer decisions on this host: an InstallError is one line naming
    the role, its profile and what the installer said."""
    from fdsched.core.settings import SettingsError, load_settings
    from fdsched.install.installer import InstallError, decide
    from fdsched.install.probe import probe

    try:
        info = probe()
    except Exception:  # noqa: BLE001 - the engine's own load will say what is wrong with the host
        return []
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FDSCHED_PROFILE")}
    problems, seen = [], set()
    for name, role, profile in instance_profiles(c):
        if (role, profile) in seen:
            continue
        seen.add((role, profile))
        try:
            decide(load_settings(environ, profile=profile), info)
        except (InstallError, SettingsError) as exc:
            origin = f"--role-profiles {role}" if profile != c.profile else "--profile"
            problems.append(f"{origin} {profile or 'default'}: the {role} instances cannot run it here: {exc}")
    return problems
