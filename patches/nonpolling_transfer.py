"""Change 5 — the CPU prefix-cache transfer-done receiver waits instead of polling.

Replaces:  EngineCacheQueue.tansfer_done_queue_init (host spelling; server side: the done lists become
           lists that can wait and that count a result being handled as pending),
           EngineCacheQueue.get_transfer_done_signal (client side: one blocking RPC),
           EngineCacheQueue.__init__ (asks the server once whether its lists can wait)
Why:       the host's ``recv_data_transfer_result`` thread (engine process) calls
           ``get_transfer_done_signal()`` every 1 ms, idle or not: 3 RPCs to the queue's manager process
           per call, about 2,200 RPCs/s and ~10% of a core on each side; a result waits up to a poll
           interval before it is handled, while ``issue_swap_task`` holds the KV-cache lock.
Upstream:  PR 7520 (closed). Its idea — block on a server-side queue — is kept; its faults are not (no
           ``or True``, no process started from a thread, no second queue, no swallowed errors, no event
           that nothing waits on: docs/internals.md, "nonpolling_transfer").
Needs it:  every 2.6 host.
Switch:    FDSCHED_NONPOLLING_TRANSFER / changes.nonpolling_transfer = auto | on | off;
           FDSCHED_TRANSFER_WAIT_SECONDS (0.5): the longest single wait.
Delete:    when upstream ships a blocking transfer-done path.
Relies on: (probed at install: ``on`` fails naming it; ``auto`` skips)
  * done-list-attribute: ``EngineCacheQueue.__init__`` builds the server-side done lists by assigning
    ``self.tansfer_done_queue_init`` (a data descriptor of the plugin wraps them as they are assigned), and
    ``get_transfer_done_signal`` reads ``self.tansfer_done_queue``.

How: the server's done lists (in the manager process the engine forks, after the plugin is installed) are the
plugin's :class:`WaitableDoneList`; the producers' ``append`` wakes a waiting receiver; the receiver's client
blocks in the manager process for up to the wait. A client of a host server polls as the host does, with a
warning. Where each end runs, and why a result taken is always acknowledged: docs/internals.md,
"nonpolling_transfer".
"""

from __future__ import annotations

import threading

from fdsched.patches._spec import PatchSpec, Reliance
from fdsched.patches._base import InstanceAttribute, host_global

ECQ = "fastdeploy.inter_communicator.engine_cache_queue"

# How a client asks, once, whether the server's done list is the plugin's: ``count(WAITABLE_QUERY)``. No item the
# host puts there (a tuple) equals the marker, so the host's list answers 0; the plugin's answers a count no list can.
WAITABLE_QUERY = "fdsched: can this done list wait?"
WAITABLE_ANSWER = -1


class WaitableDoneList(list):
    """The server-side done list, able to wait, and honest about results in flight.

    ``pop(index, wait, ack)`` waits up to ``wait`` seconds for an item (None when none came: the only
    "nothing yet"). An item taken with a ``wait`` counts as in flight until the receiver's next call
    acknowledges it (``ack=True``: the host's loop asks again only after handling the last result), and
    ``len()`` includes in-flight items — so the host's own ``result_queue_empty()``, which ``reset
    (wait_for_tasks_done=True)`` polls, stays False until every result has been handled, closing the
    host's pop-before-handle window. Plain ``pop(index)`` and every other list operation behave as on a
    list; appends wake a waiting receiver.
    """

    def __init__(self, items=()):
        super().__init__(items)
        self._ready = threading.Condition()
        self._in_flight = 0

    def __len__(self):
        return super().__len__() + self._in_flight

    def append(self, item):
        with self._ready:
            super().append(item)
            self._ready.notify_all()

    def extend(self, items):
        with self._ready:
            super().extend(items)
            self._ready.notify_all()

    def insert(self, index, item):
        with self._ready:
            super().insert(index, item)
            self._ready.notify_all()

    def count(self, value):
        if isinstance(value, str) and value == WAITABLE_QUERY:
            return WAITABLE_ANSWER  # the client's question when it is built (docs/internals.md, "nonpolling_transfer")
        return super().count(value)

    def pop(self, index=-1, wait=None, ack=False):
        with self._ready:
            if ack and self._in_flight:
                self._in_flight -= 1
            if wait is None:
                return super().pop(index)
            if not self._ready.wait_for(lambda: list.__len__(self) > 0, timeout=wait):
                return None
            self._in_flight += 1
            return super().pop(index)


class WaitableDoneLists(InstanceAttribute):
    """Data descriptor for the host's server-side done lists (``tansfer_done_queue_init``): wrapped as the host assigns
    them, where the queue's class serves waiting receivers (``_fdsched_serves_waiting``); stored as they are
    otherwise."""

    def __set__(self, obj, value):
        if type(obj)._fdsched_serves_waiting:
            value = [WaitableDoneList(items) for items in value]
        obj.__dict__[self.name] = value


# ---- receivers: how a client takes the next transfer-done signal (one per client, chosen when it is built) -------
class PollingReceiver:
    """The host's own receiver: one poll of the server's list per call (an arm without this change, or a server
    whose lists cannot wait)."""

    seams = ("get_transfer_done_signal",)
    fdsched_host_role = "passes the call to the host's own method"

    def __init__(self, host_take):
        self._host_take = host_take  # the host's get_transfer_done_signal

    def get_transfer_done_signal(self, queue, *args, **kwargs):
        return self._host_take(queue, *args, **kwargs)


class WaitingReceiver:
    """One blocking RPC per call: the next result, or None after ``wait_seconds``; acknowledges the previous result
    (see :class:`WaitableDoneList`)."""

    seams = ("get_transfer_done_signal",)
    fdsched_globals = {ECQ: ("logger",)}

    def __init__(self, wait_seconds: float):
        self.wait_seconds = wait_seconds
        self.unacked = False  # the last result taken is being handled by the receiver

    def get_transfer_done_signal(self, queue):
        data = queue.tansfer_done_queue.pop(0, self.wait_seconds, self.unacked)
        self.unacked = data is not None
        if data is not None:
            host_global(ECQ, "logger").info(f"[fdsched] transfer done signal for task {data[-1]} received")
        return data


# The receiver of a client whose arm decided ``impl`` for this change (the catalogue's strategy table).
RECEIVERS = {"plugin": WaitingReceiver, "host": PollingReceiver, "off": PollingReceiver}


def receiver_for(queue, impl: str, settings, host_take):
    """The receiver ``queue`` (a client, just built) uses under an arm that decided ``impl`` with ``settings``:
    :data:`RECEIVERS`' entry, built from the settings; a waiting one only when the server's list can wait (asked
    once, here), else the host's polling with a warning."""
    if RECEIVERS[impl] is PollingReceiver:
        return PollingReceiver(host_take)
    try:
        waitable = queue.tansfer_done_queue.count(WAITABLE_QUERY) == WAITABLE_ANSWER
        why = "the cache queue server has no waitable done list (was it started without the plugin?)"
    except Exception as exc:  # noqa: BLE001 - a server that cannot be asked is one this client polls
        waitable = False
        why = f"asking the cache queue server whether its done list can wait failed ({type(exc).__name__})"
    if not waitable:
        host_global(ECQ, "logger").warning(f"[fdsched] {why}; this client polls as the host does")
        return PollingReceiver(host_take)
    return WaitingReceiver(settings["tunables.transfer_wait_seconds"])


def _uses_done_list(info):
    from fdsched.patches._base import code_names

    names = code_names(info.host_classes["EngineCacheQueue"].__init__)
    if "tansfer_done_queue_init" not in names:
        return "EngineCacheQueue.__init__ no longer builds tansfer_done_queue_init; the waitable list cannot attach"
    if "tansfer_done_queue" not in code_names(info.host_classes["EngineCacheQueue"].get_transfer_done_signal):
        return "EngineCacheQueue.get_transfer_done_signal no longer reads tansfer_done_queue"
    return None


SPEC = PatchSpec(
    change_id="nonpolling_transfer",
    title="Non-polling CPU-cache transfer-done path",
    upstream_prs=(7520,),
    upstream_state="closed",
    replaces=(
        "EngineCacheQueue.__init__",
        "EngineCacheQueue.tansfer_done_queue_init",
        "EngineCacheQueue.get_transfer_done_signal",
    ),
    why="The receiver polls an RPC every millisecond even when idle, and a result waits for the next poll.",
    how="The server's done list can wait; the receiver's get blocks in the server for up to "
    "FDSCHED_TRANSFER_WAIT_SECONDS; a result being handled still counts as pending for reset().",
    hosts_needing="all 2.6 hosts",
    switch="FDSCHED_NONPOLLING_TRANSFER",
    delete_when="upstream ships a blocking transfer-done path",
    strategies={"EngineCacheQueue": RECEIVERS},
    host_has=lambda info: False,
    relies_on=(
        Reliance("done-list-attribute", "EngineCacheQueue.__init__ builds the server's done lists by assigning "
                 "tansfer_done_queue_init, and get_transfer_done_signal reads tansfer_done_queue", _uses_done_list),
    ),
)
