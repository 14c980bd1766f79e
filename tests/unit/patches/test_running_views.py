"""The scheduler's views of its running requests (fdsched.patches.ratio_reserve): what the reservation strategy
reads of each, and the open pass's kept views (a request that generated nothing since the last ask is seen as it
was; one that did, or another object under the same id, is seen afresh)."""

from __future__ import annotations

from types import SimpleNamespace

from fdsched.patches.ratio_reserve import _BudgetedReserve


def _scheduler(running, max_model_len=2048):
    return SimpleNamespace(
        config=SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len)),
        running=running,
        _fdsched_is_decoding=lambda request: len(request.output_token_ids) > 0,
    )


def _request(rid, prompt_len, generated, max_tokens):
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids_len=prompt_len,
        output_token_ids=[7] * generated,
        sampling_params=SimpleNamespace(max_tokens=max_tokens),
    )


def _views(scheduler, **kw):
    return _BudgetedReserve._fdsched_views(scheduler, **kw)


def test_a_view_is_the_budget_generated_and_client_bound_of_its_request():
    bounded, unbounded = _request("a", 16, 3, 512), _request("b", 48, 0, 2000)  # 2000 >= 2048 - 48: no bound
    (a, b) = _views(_scheduler([bounded, unbounded]))
    assert (a.request_id, a.budget, a.generated, a.max_tokens, a.decoding) == ("a", 512, 3, 512, None)
    assert (b.budget, b.max_tokens) == (2000, None)
    assert [v.decoding for v in _views(_scheduler([bounded, unbounded]), with_phase=True)] == [True, False]


def test_the_passs_kept_views_are_reused_until_the_request_generates_or_is_another_object():
    a, b = _request("a", 16, 3, 512), _request("b", 16, 0, None)
    scheduler, kept = _scheduler([a, b]), {}
    first = _views(scheduler, kept=kept)
    again = _views(scheduler, kept=kept)
    assert all(x is y for x, y in zip(first, again))  # nothing changed: the same views
    a.output_token_ids.append(7)  # the token processor appended a token
    scheduler.running = [a, b, _request("c", 16, 0, 64)]  # and a request was admitted
    third = _views(scheduler, kept=kept)
    assert third[0] is not first[0] and third[0].generated == 4 and third[1] is first[1]
    assert third[2].request_id == "c" and set(kept) == {"a", "b", "c"}
    scheduler.running = [_request("a", 16, 4, 256)]  # another object under a's id (preempted and re-added)
    (fresh,) = _views(scheduler, kept=kept)
    assert fresh.budget == 256
    assert _views(scheduler, kept=kept)[0] == _views(scheduler)[0]  # kept or not, the same values


def test_the_readers_lefts_and_keys_are_what_the_views_say():
    from fdsched.patches.ratio_reserve.budget import _RunningReader

    requests = [
        _request("bounded", 16, 3, 512),
        _request("unset", 48, 7, None),
        _request("at-room", 48, 0, 2000),  # 2000 = 2048 - 48: not the client's bound
        _request("over-room", 48, 0, 5000),
        _request("zero", 16, 0, 0),
        _request("over-budget", 16, 600, 512),
        _request("float", 16, 2, 100.0),
    ]
    scheduler = _scheduler(requests)
    scheduler._fdsched_views = lambda requests=None, kept=None: _views(scheduler, requests=requests, kept=kept)
    reader = _RunningReader(scheduler)
    views = _views(scheduler)
    assert reader.lefts(requests) == [v.budget - v.generated for v in views]
    assert reader.keys(requests) == [(v.max_tokens, v.budget, v.generated) for v in views]
    assert reader.views(requests[:2]) == views[:2]
