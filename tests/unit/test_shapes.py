"""Host shapes: the checks made before anything is patched (fdsched.patches._spec), on plain classes.

The hosts' real shapes (2.4/2.5's threshold with the request, develop's ``batch_request``) are checked on the
hosts themselves (tests/host); here each rule, with classes written for it.
"""

from __future__ import annotations

import types

from fdsched.entry import asked_for
from fdsched.patches._spec import Shapes, call_problem, format_shape, shape_of, strategy_problem, uses_problem


class Host:
    def check(self, num_blocks, try_free=True):
        return num_blocks

    def threshold(self, request, num_chunk_new_block):
        return num_chunk_new_block

    def preempt(self, request, num_new_blocks, preempted_reqs, batch_request):
        return True




def strategy(name, **methods):
    """A strategy class serving ``methods`` (each takes the strategy, then the host object, then the host's own
    parameters)."""
    seams = tuple(n for n, v in methods.items() if callable(v) and not n.startswith("_fdsched"))
    cls = types.new_class(name, (), {}, lambda ns: ns.update(methods, seams=seams))
    cls.__module__ = "fdsched.tests_shapes"
    return cls


def test_a_matching_seam_passes():
    assert strategy_problem(strategy("Ok", check=lambda self, host, num_blocks, try_free=True: 0), Host) is None


def test_arity_differs_is_named_with_both_shapes():
    problem = strategy_problem(strategy("OneArg", check=lambda self, host, num_blocks: 0), Host)
    assert problem == "Host.check(self, num_blocks, try_free=True) differs from the (self, num_blocks) the plugin handles"


def test_a_default_or_a_name_that_differs_is_a_different_shape():
    assert strategy_problem(strategy("D", check=lambda self, host, num_blocks, try_free=False: 0), Host)
    assert strategy_problem(strategy("N", threshold=lambda self, host, num_chunk_new_block: 0), Host)
    assert strategy_problem(strategy("K", check=lambda self, host, num_blocks, *, try_free=True: 0), Host)


def test_a_seam_the_host_lacks_is_named():
    assert strategy_problem(strategy("M", seam=lambda self, host: 0), Host) == "Host.seam is missing (the plugin serves it)"


def test_only_served_seams_are_checked_and_a_pass_through_takes_any_shape():
    served = strategy("W", preempt=lambda self, host, *a, **k: 0)
    served.helper = lambda self, x: 0  # not a seam: not compared with the host
    assert strategy_problem(served, Host) is None


def test_shapes_pick_the_first_that_fits_else_the_first_difference():
    two = strategy("Two", check=lambda self, host, num_blocks, try_free=True: 0)
    one = strategy("One", check=lambda self, host, num_blocks: 0)
    assert Shapes(one, two).pick(Host) == (two, None)
    OneArgHost = type("OneArgHost", (), {"check": lambda self, num_blocks: 0})
    assert Shapes(two, one).pick(OneArgHost) == (one, None)
    none_fit = Shapes(strategy("Three", check=lambda self, host, a, b, c: 0), two)
    chosen, problem = none_fit.pick(OneArgHost)
    assert chosen is None and problem.startswith("OneArgHost.check(self, num_blocks) differs from the (self, a, b, c)")


def test_a_call_must_fit_by_position_name_and_leave_no_required_parameter():
    assert call_problem(Host, "check", ("num_blocks",)) is None
    assert call_problem(Host, "threshold", ("num_chunk_new_block",)) is not None  # the request comes first there
    assert call_problem(Host, "preempt", ("request", "num_new_blocks", "preempted_reqs", "scheduled_reqs")) == (
        "Host.preempt(self, request, num_new_blocks, preempted_reqs, batch_request) does not take the plugin's call "
        "(request, num_new_blocks, preempted_reqs, scheduled_reqs)"
    )
    assert call_problem(Host, "preempt", ("request",)) is not None  # required parameters left over
    assert call_problem(Host, "nothing", ()) == "Host.nothing is missing"


def test_declared_calls_and_globals_are_checked_but_an_overridden_call_is_an_override():
    import sys

    module = types.ModuleType("fdsched_test_hostmod")
    module.logger = object()
    sys.modules[module.__name__] = module
    try:
        uses = strategy(
            "Uses", fdsched_calls={"Host.check": ("num_blocks",)}, fdsched_globals={module.__name__: ("logger",)}
        )
        assert uses_problem(uses, "Host", {"Host": Host}) is None
        missing = strategy("Missing", fdsched_globals={module.__name__: ("logger", "envs")})
        assert uses_problem(missing, "Host", {"Host": Host}) == "fdsched_test_hostmod has no envs"
        bad_call = strategy("BadCall", fdsched_calls={"Host.threshold": ("num_chunk_new_block",)})
        assert "does not take the plugin's call" in uses_problem(bad_call, "Host", {"Host": Host})
        serving = strategy("Serving", fdsched_calls={"Host.threshold": ("num_chunk_new_block",)},
                           threshold=lambda self, host, request, num_chunk_new_block: 0)
        assert uses_problem(serving, "Host", {"Host": Host}) is None  # a seam it serves is checked as a seam
    finally:
        del sys.modules[module.__name__]


def test_shapes_print_as_python_signatures():
    assert format_shape(shape_of(lambda self, a, b=1, *args, c, d=None, **kw: 0)) == "(self, a, b=1, *args, c, d=None, **kw)"
    assert format_shape(shape_of(lambda self, *, k: 0)) == "(self, *, k)"


def test_the_plugin_acts_only_when_fd_plugins_names_it():
    assert asked_for({"FD_PLUGINS": "fdsched"})
    assert asked_for({"FD_PLUGINS": "other, fdsched"})
    assert not asked_for({})  # unset: an old loader calls every plugin; this one does nothing then
    assert not asked_for({"FD_PLUGINS": ""})
    assert not asked_for({"FD_PLUGINS": "fdsched2,other"})


def test_declared_attributes_must_be_set_by_the_hosts_init_or_its_class():
    from fdsched.patches._spec import host_sets

    class Base:
        def __init__(self):
            self.lock = object()

    class Host(Base):
        limit = 3

        def __init__(self):
            super().__init__()
            self.running = []
            if self.running is None:
                self.waiting = []  # assigned on some path only: the host has it

    assert host_sets(Host, "running") and host_sets(Host, "lock") and host_sets(Host, "limit")
    assert host_sets(Host, "waiting") and not host_sets(Host, "requests")
    reads = strategy("Reads", fdsched_attributes=("running", "requests"))
    assert uses_problem(reads, "Host", {"Host": Host}) == "Host sets no requests (the plugin reads it)"
