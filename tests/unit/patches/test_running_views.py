"""The scheduler's views of its running requests (fdsched.patches.ratio_reserve): what the reservation strategy
reads of each, and the open pass's kept views (a request that generated nothing since the last ask is seen as it
was; one that did, or another object under the same id, is seen afresh)."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest

from fdsched.patches.ratio_reserve.budget import running_views


def _scheduler(running, max_model_len=2048):
    return SimpleNamespace(
        config=SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len)),
        running=running,
        _fdsched_is_decoding=lambda request: len(request.output_token_ids) > 0,
    )


def _most(budget):
    """A request's most possible reservation, as a ratio strategy gives it (ratio 0.7, clip 4096, block 64)."""
    from fdsched.core.admission import reserve_blocks_for_request

    return reserve_blocks_for_request(budget, 0, 0.7, 4096, 64)


def _no_most(budget):
    return 0


def _request(rid, prompt_len, generated, max_tokens):
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids_len=prompt_len,
        output_token_ids=[7] * generated,
        sampling_params=SimpleNamespace(max_tokens=max_tokens),
    )


def _views(scheduler, **kw):
    return running_views(scheduler, **kw)


def _views_of(scheduler):
    """The views function a reader gets for ``scheduler``."""
    return lambda requests=None, kept=None: _views(scheduler, requests=requests, kept=kept)


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
    from fdsched.patches.ratio_reserve.reader import _RunningReader

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
    reader = _RunningReader(scheduler, _views_of(scheduler), _no_most)
    views = _views(scheduler)
    assert reader.lefts(requests) == [v.budget - v.generated for v in views]
    assert reader.keys(requests) == [(v.max_tokens, v.budget, v.generated) for v in views]
    assert reader.views(requests[:2]) == views[:2]


class _Request:
    """A plain object a weak reference can point to (as the host's request objects)."""

    def __init__(self, rid, prompt_len, generated, max_tokens):
        self.request_id, self.prompt_token_ids_len = rid, prompt_len
        self.output_token_ids = [7] * generated
        self.sampling_params = SimpleNamespace(max_tokens=max_tokens)


class _CountedParams:
    """Sampling parameters that count how often ``max_tokens`` is read."""

    def __init__(self, max_tokens):
        self._max_tokens, self.reads = max_tokens, 0

    @property
    def max_tokens(self):
        self.reads += 1
        return self._max_tokens


def _kept_reader(requests):
    from fdsched.patches.ratio_reserve.reader import reader_for

    scheduler = _scheduler(requests)
    return scheduler, reader_for(scheduler, _Request, _views_of(scheduler), _most)


def test_the_kept_terms_reader_answers_as_the_views_for_every_kind_of_request():
    from fdsched.patches.ratio_reserve.reader import _KeptTermsReader

    requests = [_Request("bounded", 16, 3, 512), _Request("unset", 48, 7, None), _Request("at-room", 48, 0, 2000),
                _Request("over-room", 48, 0, 5000), _Request("zero", 16, 0, 0), _Request("over-budget", 16, 600, 512),
                _Request("float", 16, 2, 100.0)]
    scheduler, reader = _kept_reader(requests)
    assert isinstance(reader, _KeptTermsReader)
    for _ in range(2):  # read, then kept
        views = _views(scheduler)
        assert reader.lefts(requests) == [v.budget - v.generated for v in views]
        assert reader.keys(requests) == [(v.max_tokens, v.budget, v.generated) for v in views]
        for r in requests:
            r.output_token_ids.append(7)  # outputs grow between passes: read afresh every time


def test_both_readers_give_the_keys_as_the_arrays_the_estimator_reads():
    from fdsched.core.terms import columns_of_keys, numpy_or_none
    from fdsched.patches.ratio_reserve.reader import _RunningReader

    if numpy_or_none() is None:
        pytest.skip("unit: numpy not installed (the terms are then computed one by one)")
    requests = [_Request("bounded", 16, 3, 512), _Request("unset", 48, 7, None), _Request("zero", 16, 0, 0),
                _Request("over-budget", 16, 600, 512), _Request("float", 16, 2, 100.0)]
    scheduler, kept = _kept_reader(requests)
    fresh = _RunningReader(scheduler, _views_of(scheduler), _no_most)
    late = _Request("late", 16, 9, 64)
    for reader in (kept, fresh):
        for _ in range(2):  # kept: first read, then from the table (and one request it has not seen yet)
            for got, want in zip(reader.columns(requests), columns_of_keys(reader.keys(requests))):
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
            if late not in requests:
                requests.append(late)
            for r in requests:
                r.output_token_ids.append(7)


def test_a_requests_terms_are_read_once_and_its_output_every_time():
    request = _Request("a", 16, 3, 512)
    request.sampling_params = _CountedParams(512)
    _, reader = _kept_reader([request])
    assert reader.lefts([request]) == [509] and reader.keys([request]) == [(512, 512, 3)]
    request.output_token_ids += [7, 7]
    assert reader.lefts([request]) == [507]
    assert request.sampling_params.reads == 1


def test_another_object_at_a_kept_address_is_read_afresh():
    """An entry goes with its request, before the address can be reused: a request that takes a gone one's
    address is read for itself (with the entry left behind, it would be counted with the gone one's budget)."""
    _, reader = _kept_reader([])
    born, found = [], None  # kept alive, so each new object takes a new address until one takes a gone one's
    for _ in range(20):  # CPython hands the freed memory out again, mostly: else its pool went to another size
        first = _Request("first", 16, 0, 64)
        assert reader.lefts([first]) == [64]
        address = id(first)
        del first
        assert address not in reader._terms  # gone with its request, before anything can take the address
        for _ in range(1000):
            born.append(_Request(f"new{len(born)}", 16, 0, 512))
            if id(born[-1]) == address:
                found = born[-1]
                break
        if found is not None:
            break
    assert found is not None, "no new request took a gone one's address in 20 tries"
    assert reader.lefts([found]) == [512] and reader.keys([found]) == [(512, 512, 0)]


def test_the_kept_table_holds_the_live_requests_only_and_keeps_none_alive():
    live = [_Request(f"live{i}", 16, 0, 64) for i in range(3)]
    _, reader = _kept_reader([])
    ended = [_Request(f"ended{i}", 16, 0, 32) for i in range(4)]
    assert reader.lefts(live + ended) == [64] * 3 + [32] * 4
    assert len(reader._terms) == len(reader._refs) == 7
    watch = weakref.ref(ended[0])
    del ended  # they left the scheduler: nothing here holds them, and their entries go with them
    assert watch() is None
    assert set(reader._terms) == set(reader._refs) == {id(r) for r in live}
    assert reader.lefts(live) == [64, 64, 64]


def test_requests_no_weak_reference_can_point_to_are_read_afresh():
    from fdsched.patches.ratio_reserve.reader import _KeptTermsReader, _RunningReader, reader_for

    scheduler = _scheduler([])
    views = _views_of(scheduler)
    assert type(reader_for(scheduler, SimpleNamespace, views, _most)) is _RunningReader  # objects take no weak reference
    assert type(reader_for(scheduler, None, views, _most)) is _RunningReader  # the host module has no request class
    assert type(reader_for(scheduler, _Request, views, _most)) is _KeptTermsReader


def test_the_kept_reader_reuses_the_last_arrays_only_where_the_running_list_begins_as_it_did():
    import random

    from fdsched.core.terms import columns_of_keys, numpy_or_none

    if numpy_or_none() is None:
        pytest.skip("unit: numpy not installed (the terms are then computed one by one)")
    rnd = random.Random(4)

    def made(i):
        return _Request(f"r{i}", rnd.choice((16, 48)), rnd.randint(0, 40), rnd.choice((None, 0, 64, 512, 5000)))

    running = [made(i) for i in range(30)]
    _, reader = _kept_reader(running)
    born = 30
    for step in range(300):  # admissions at the end, finishes and preemptions anywhere, a new request at an old place
        change = rnd.randrange(6)
        if change == 0:
            running += [made(born + j) for j in range(rnd.randint(1, 3))]
            born += 3
        elif change == 1 and running:
            running.pop(rnd.randrange(len(running)))
        elif change == 2 and running:
            running[rnd.randrange(len(running))] = made(born)
            born += 1
        elif change == 3:
            rnd.shuffle(running)
        for r in running:
            r.output_token_ids.extend([7] * rnd.randint(0, 2))
        got = reader.columns(running)
        want = columns_of_keys(reader.keys(running)) if running else None
        if want is None:
            assert all(len(column) == 0 for column in got)
            continue
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"step {step}, change {change}"


def test_both_readers_give_the_requests_mosts_together_kept_or_not():
    from fdsched.patches.ratio_reserve.reader import _RunningReader

    requests = [_Request(f"r{i}", 16 + i, i % 5, [None, 64, 512, 3000][i % 4]) for i in range(40)]
    scheduler, kept = _kept_reader(requests)
    fresh = _RunningReader(scheduler, _views_of(scheduler), _most)
    expected = sum(_most(budget) for budget, _ in map(fresh.terms, requests))
    assert fresh.mosts(requests) == expected
    kept.keys(requests[5:9])  # a few kept already, in the middle; the rest are kept by the count itself
    assert kept.mosts(requests) == expected
    assert kept.mosts(requests) == expected  # and read from the table the second time
    for r in requests:
        r.output_token_ids.extend([7] * 50)  # a request's most does not depend on what it generated
    assert kept.mosts(requests) == fresh.mosts(requests) == expected


def test_every_patches_module_stays_under_450_lines():
    """One file, one implementation: a module that grows past this is split."""
    from pathlib import Path

    import fdsched.patches

    root = Path(fdsched.patches.__file__).parent
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert sizes and {name: n for name, n in sizes.items() if n >= 450} == {}


def test_a_block_check_is_taken_to_answer_true_when_covered_only_in_the_hosts_shape():
    from fdsched.patches.ratio_reserve.reader import answers_true_when_covered

    def hosts(self, num_blocks: int, try_free_gpu_blocks: bool = True):
        """Check if num_blocks gpu blocks can be allocated."""
        if len(self.gpu_free_block_list) < num_blocks:
            if try_free_gpu_blocks:
                self.free_block_ids(num_blocks)
            return len(self.gpu_free_block_list) >= num_blocks
        else:
            return True

    def watermark(self, num_blocks):
        if len(self.gpu_free_block_list) - self.watermark < num_blocks:
            return False
        else:
            return True

    def acts_first(self, num_blocks):
        self.touch()
        if len(self.gpu_free_block_list) < num_blocks:
            return False
        else:
            return True

    def answers_otherwise(self, num_blocks):
        if len(self.gpu_free_block_list) < num_blocks:
            return False
        else:
            return self.reserve(num_blocks)

    def takes_blocks(self, num_blocks):
        if len(self.gpu_free_block_list) < num_blocks:
            return False
        del self.gpu_free_block_list[:num_blocks]
        return True

    assert answers_true_when_covered(hosts)
    assert not any(map(answers_true_when_covered, (watermark, acts_first, answers_otherwise, takes_blocks, len)))
