"""The scheduler's policy on plain data (serving/batch_policy.py): admission, prefix reuse and eviction, `n` groups
and the chunking of prompts, with no engine, thread or clock. Each test drives the policy as the scheduler's loop
does (`next_admission` then `started`, `wrote`, `ended`) and checks its decisions and its page accounting.
"""

from __future__ import annotations

import math

from ember.serving.batch_policy import BatchPolicy, Limits, PlannedRequest

PAGE = 16


def _policy(max_batch: int = 4, kv_capacity: int = 128, prefill_chunk: int = 64, prefix_cache: bool = True,
            max_decode_stall: float = 0.1) -> BatchPolicy[PlannedRequest]:
    return BatchPolicy(Limits(max_batch, kv_capacity, PAGE, prefill_chunk), prefix_cache, max_decode_stall)


def _request(policy: BatchPolicy[PlannedRequest], prompt: list[int], new_tokens: int = 8,
             n: int = 1) -> PlannedRequest:
    """A request queued as the scheduler queues one: its reservation page-rounded, its choices following it."""
    reserve = policy.limits.pages(len(prompt) + new_tokens)
    leader, *followers = [PlannedRequest(prompt, reserve, index=i) for i in range(n)]
    leader.followers = followers
    for follower in followers:
        follower.leader = leader
    policy.waiting.append(leader)
    return leader


def _prompt(length: int, start: int = 0) -> list[int]:
    return [start + i for i in range(length)]


class _Sequences:
    """Sequence ids as an engine hands them out, and what the policy had it free."""

    def __init__(self) -> None:
        self.next_id = 0
        self.freed: list[int] = []

    def admit_all(self, policy: BatchPolicy[PlannedRequest]) -> list[PlannedRequest]:
        """Carry out every admission the policy makes now; the requests admitted."""
        admitted = []
        while (admission := policy.next_admission()) is not None:
            self.freed += admission.evicted
            if admission.take_over:
                assert admission.parent is not None
                seq = admission.parent
            else:
                seq, self.next_id = self.next_id, self.next_id + 1
            policy.started(admission, seq)
            admitted.append(admission.request)
        return admitted


def _run_to_end(policy: BatchPolicy[PlannedRequest], request: PlannedRequest, generated: int = 0,
                how: str = "stop") -> None:
    """Read a running request's whole prompt, generate `generated` tokens, end it as `how`."""
    policy.wrote(request.seq, request.prompt_ids[request.prefilled:])
    request.prefilled = len(request.prompt_ids)
    policy.wrote(request.seq, [999] * generated)
    length = len(request.prompt_ids) + generated
    policy.ended(request, policy.keeps(how, length), length)


def test_admission_is_first_in_first_out_within_the_reserved_pages():
    """A cache of 128 tokens holds two requests reserving 48 each (40 prompt + 8 new): the third waits, and a
    small request behind it waits too, so the large one is never passed; when one ends, the third goes first."""
    policy, sequences = _policy(prefix_cache=False), _Sequences()
    first, second, third = (_request(policy, _prompt(40, start=100 * i)) for i in range(3))
    small = _request(policy, _prompt(4, start=900), new_tokens=4)
    assert sequences.admit_all(policy) == [first, second]
    assert policy.reserved == 96 and list(policy.waiting) == [third, small]
    _run_to_end(policy, first, generated=8)
    assert policy.reserved == 48
    assert sequences.admit_all(policy) == [third, small]
    assert policy.reserved == 48 + 48 + 16 <= policy.limits.kv_capacity


def test_the_batch_limits_sequences_and_a_group_of_choices_is_admitted_whole():
    """With 4 slots and 2 taken, a request for 3 choices waits (3 sequences); once one slot frees, the group is
    admitted in one piece: every choice runs, and it reserves three times one choice's pages."""
    policy, sequences = _policy(max_batch=4, kv_capacity=512, prefix_cache=False), _Sequences()
    running = [_request(policy, _prompt(8, start=100 * i)) for i in range(2)]
    group = _request(policy, _prompt(20, start=500), new_tokens=12, n=3)
    assert sequences.admit_all(policy) == running
    assert policy.next_admission() is None and list(policy.waiting) == [group]
    _run_to_end(policy, running[0])
    assert sequences.admit_all(policy) == [group]
    assert policy.running == [running[1], *group.group] and policy.reserved == 16 + 3 * 32
    assert group.seq_id is not None and all(follower.seq_id is None for follower in group.followers)


def test_a_group_of_choices_reserves_pages_for_each():
    """Three choices reserving 32 tokens each do not fit beside a request reserving 48 in 128 tokens, although
    one would and the slots are free: the group waits for the pages of all three."""
    policy, sequences = _policy(max_batch=8, kv_capacity=128, prefix_cache=False), _Sequences()
    running = _request(policy, _prompt(40))
    group = _request(policy, _prompt(20), new_tokens=12, n=3)
    assert sequences.admit_all(policy) == [running]
    _run_to_end(policy, running, how="cancelled")
    assert sequences.admit_all(policy) == [group] and policy.reserved == 96


def test_followers_fork_their_leaders_prompt_and_are_never_read():
    """Only the leader of a group reads the prompt; its followers get their sequences once it is read, holding
    the whole prompt, and from then on decode beside it."""
    policy, sequences = _policy(), _Sequences()
    group = _request(policy, _prompt(40), n=2)
    sequences.admit_all(policy)
    reading = policy.next_prefill()
    assert reading is not None and reading[0] is group
    _run_to_end_prompt(policy, group)
    assert policy.next_prefill() is None
    follower = group.followers[0]
    policy.forked(follower, 7)
    assert follower.prefilled == 40 and policy.prefix is not None and policy.prefix.length(7) == 40
    group.pending, follower.pending = 3, 5
    assert policy.decode_batch() == [(group, 3), (follower, 5)]


def _run_to_end_prompt(policy: BatchPolicy[PlannedRequest], request: PlannedRequest) -> None:
    policy.wrote(request.seq, request.prompt_ids[request.prefilled:])
    request.prefilled = len(request.prompt_ids)


def test_a_prompt_starting_as_a_running_sequence_forks_it_and_reads_only_the_rest():
    """A running sequence holds 40 prompt tokens and 5 generated; a new prompt sharing its first 45 tokens and
    adding 10 forks those 45 (the last prompt token is always read, for its logits)."""
    policy, sequences = _policy(kv_capacity=256), _Sequences()
    first = _request(policy, _prompt(40))
    sequences.admit_all(policy)
    _run_to_end_prompt(policy, first)
    policy.wrote(first.seq, [1000, 1001, 1002, 1003, 1004])
    second = _request(policy, [*_prompt(40), 1000, 1001, 1002, 1003, 1004, *_prompt(10, start=2000)])
    admission = policy.next_admission()
    assert admission is not None and admission.request is second
    assert (admission.parent, admission.shared, admission.take_over, admission.evicted) == (first.seq, 45, False, [])
    policy.started(admission, 1)
    assert second.prefilled == second.reused == 45
    assert policy.next_prefill() == (second, 64)


def test_a_prefix_is_shared_only_by_requests_of_the_same_adapter_and_scale():
    """A sequence run with a LoRA adapter holds that adapter's keys and values: a prompt for the base model, another
    adapter or another scale of it reads its own; one for the same adapter and scale forks it."""
    policy, sequences = _policy(max_batch=6, kv_capacity=512), _Sequences()
    first = _request(policy, _prompt(40))
    first.adapter = ("sql", 1.0)
    sequences.admit_all(policy)
    _run_to_end_prompt(policy, first)
    for adapter, parent in ((None, None), (("poet", 1.0), None), (("sql", 0.5), None), (("sql", 1.0), first.seq)):
        request = _request(policy, _prompt(40) + [7])
        request.adapter = adapter
        admission = policy.next_admission()
        assert admission is not None and admission.request is request
        assert admission.parent == parent, adapter
        policy.started(admission, sequences.next_id)
        sequences.next_id += 1


def test_a_shared_prefix_shorter_than_a_page_is_not_worth_a_fork():
    policy, sequences = _policy(), _Sequences()
    first = _request(policy, _prompt(40))
    sequences.admit_all(policy)
    _run_to_end_prompt(policy, first)
    _request(policy, [*_prompt(PAGE - 1), *_prompt(30, start=5000)])
    admission = policy.next_admission()
    assert admission is not None and admission.parent is None and admission.shared == 0


def test_finished_requests_stay_as_entries_and_are_evicted_least_recently_used_first():
    """Three requests end and stay as entries (their pages counted as cached); a prompt matching the oldest makes it
    the most recently used; a new request that needs room evicts the next-oldest first and only as many as it
    needs. A request that failed or was cancelled is never kept."""
    policy, sequences = _policy(max_batch=8, kv_capacity=160), _Sequences()
    requests = [_request(policy, _prompt(30, start=1000 * i), new_tokens=2) for i in range(3)]
    sequences.admit_all(policy)
    for request in requests:
        _run_to_end(policy, request, generated=2)
    assert policy.prefix is not None and policy.prefix.finished() == [0, 1, 2]
    assert policy.cached_tokens == 3 * 32 and policy.reserved == 0 and policy.running == []
    reuse = _request(policy, [*_prompt(30), *_prompt(5, start=7000)], new_tokens=2)
    [admitted] = sequences.admit_all(policy)
    assert admitted is reuse and reuse.reused == 30 and sequences.freed == []
    assert policy.prefix.finished() == [1, 2, 0]
    big = _request(policy, _prompt(40, start=9000), new_tokens=8)  # reserves 48: 160 - 48 - 96 leaves 16 short
    assert sequences.admit_all(policy) == [big]
    assert sequences.freed == [1] and policy.prefix.finished() == [2, 0] and policy.cached_tokens == 64
    failed = _request(policy, _prompt(20, start=20000))
    sequences.admit_all(policy)
    length = len(failed.prompt_ids)
    assert not policy.keeps("error", length) and not policy.keeps("cancelled", length)
    assert policy.keeps("length", length) and not policy.keeps("stop", 0)
    policy.ended(failed, keep=False, length=length)
    assert failed.seq not in policy.prefix.finished() and failed not in policy.running


def test_entries_never_make_a_request_wait():
    """Entries fill every slot and page: a new request is admitted at once, evicting what it needs."""
    policy, sequences = _policy(max_batch=2, kv_capacity=64), _Sequences()
    requests = [_request(policy, _prompt(24, start=1000 * i), new_tokens=8) for i in range(2)]
    sequences.admit_all(policy)
    for request in requests:
        _run_to_end(policy, request, generated=8)
    assert policy.cached_tokens == 64 and len(policy.running) == 0
    fresh = _request(policy, _prompt(24, start=5000), new_tokens=8)
    assert sequences.admit_all(policy) == [fresh]
    assert sequences.freed == [0] and policy.cached_tokens == 32


def test_the_matched_entry_is_taken_over_when_it_alone_stands_in_the_way():
    """Two slots: one running request, one entry. A prompt that starts with the entry's tokens cannot fork it (a
    third sequence), so it takes the entry's sequence over, cut to the shared part, and nothing is evicted."""
    policy, sequences = _policy(max_batch=2, kv_capacity=256), _Sequences()
    kept, running = _request(policy, _prompt(40), new_tokens=4), _request(policy, _prompt(20, start=3000))
    sequences.admit_all(policy)
    _run_to_end(policy, kept, generated=4)
    assert policy.prefix is not None and policy.prefix.finished() == [kept_seq := 0]
    new = _request(policy, [*_prompt(40), *_prompt(6, start=8000)])
    admission = policy.next_admission()
    assert admission is not None
    assert (admission.parent, admission.shared, admission.take_over, admission.evicted) == (kept_seq, 40, True, [])
    assert policy.prefix.finished() == [] and policy.cached_tokens == 0
    policy.started(admission, kept_seq)
    assert new.seq == kept_seq and new.prefilled == 40 and policy.prefix.length(kept_seq) == 40
    assert policy.running == [running, new]


def test_a_long_prompt_is_read_in_chunks_bounded_while_others_decode():
    """With nothing decoding a prompt goes in whole compiled chunks; while another request decodes, in one page
    until prefill is timed, then in the whole pages read in `max_decode_stall` seconds. The oldest prompt first."""
    policy, sequences = _policy(kv_capacity=1024, prefill_chunk=64, max_decode_stall=0.1), _Sequences()
    decoding = _request(policy, _prompt(20))
    long, later = _request(policy, _prompt(300, start=1000)), _request(policy, _prompt(50, start=5000))
    sequences.admit_all(policy)
    assert policy.next_prefill() == (decoding, 64)
    _run_to_end_prompt(policy, decoding)
    decoding.pending = 7
    assert policy.next_prefill() == (long, PAGE)
    policy.timed_prefill(PAGE - 1, 100.0)  # shorter than a page: mostly fixed cost, not counted
    assert policy.chunk_size(decoding=True) == PAGE
    policy.timed_prefill(32, 0.032 * 1.25)  # 1.25 ms a token: 0.1 s reads 80 tokens, 5 whole pages
    assert policy.next_prefill() == (long, 64)  # capped at the compiled chunk
    policy.timed_prefill(32, 0.032 * 4.75)  # the running figure averages to 3 ms a token: 33 tokens, 2 pages
    assert policy.next_prefill() == (long, 32)
    policy.timed_prefill(PAGE, 10.0)  # far slower than the bound: still one page a step
    assert policy.chunk_size(decoding=True) == PAGE
    assert policy.chunk_size(decoding=False) == 64
    decoding.cancelled = True  # a cancelled request neither decodes nor counts as decoding
    assert policy.decode_batch() == [] and policy.next_prefill() == (long, 64)
    _run_to_end_prompt(policy, long)
    assert policy.next_prefill() == (later, 64)


def test_an_unbounded_stall_reads_whole_chunks_even_untimed():
    policy, sequences = _policy(kv_capacity=256, max_decode_stall=math.inf), _Sequences()
    first, second = _request(policy, _prompt(10)), _request(policy, _prompt(100, start=500))
    sequences.admit_all(policy)
    _run_to_end_prompt(policy, first)
    first.pending = 1
    assert policy.next_prefill() == (second, 64)


def test_an_embedding_gets_room_only_beside_what_is_admitted():
    """An embedding input needs a free slot and pages no running request reserves; entries are evicted for it."""
    policy, sequences = _policy(max_batch=2, kv_capacity=96), _Sequences()
    running, entry = _request(policy, _prompt(40), new_tokens=8), _request(policy, _prompt(30, start=500))
    sequences.admit_all(policy)
    _run_to_end(policy, entry, generated=2)
    assert policy.room_for(49) is None  # 48 reserved + 64 > 96
    assert policy.room_for(40) == [1] and policy.cached_tokens == 0
    _run_to_end(policy, running, generated=0, how="cancelled")
    assert policy.room_for(96) == []


def test_withdraw_drain_and_evict_all():
    policy, sequences = _policy(max_batch=2), _Sequences()
    first = _request(policy, _prompt(20))
    sequences.admit_all(policy)
    _run_to_end(policy, first, generated=1)
    waiting = [_request(policy, _prompt(10, start=100 * i), n=2) for i in range(1, 4)]
    assert policy.withdraw(waiting[1]) and not policy.withdraw(waiting[1])
    assert policy.drain() == [*waiting[0].group, *waiting[2].group] and not policy.waiting
    assert policy.evict_all() == [first.seq] and policy.cached_tokens == 0
