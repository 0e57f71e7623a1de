"""The token log against a real redis-server (in one shard and in three) and a real 3-master Redis
Cluster (six shards): fencing, migration, reaping, streaming, stats; and a randomized interleaving
of claims, flushes, releases and reaps checked against a reference model."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis

from infra.rollout.controller_config import ControllerConfig
from infra.rollout.tokenlog import Flush, GroupSpec, RunningLease, ShardCountMismatch, TokenLog
from infra.services.redis_embedded import RedisSettings
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

SAMPLING = {"temperature": 1.0}
MAX_REAPS = ControllerConfig().max_reaps


@pytest.fixture
def run_id() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["one-shard", "three-shards", "cluster"])
def backend(request) -> tuple[str, int]:
    """Where the token log runs, and in how many shards (`fabric.tokenlog_shards`): one Redis with
    one shard (the default layout) or three; the session's 3-master Redis Cluster with six."""
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster_url"), 6
    return request.getfixturevalue("redis_url"), 1 if request.param == "one-shard" else 3


@pytest.fixture
def log(backend, run_id) -> Iterator[TokenLog]:
    url, shards = backend
    client = RedisSettings(url=url).client()
    yield TokenLog(client, run_id, shards=shards)
    client.close()


def groups(count: int, n: int, max_new: int = 8) -> list[GroupSpec]:
    return [
        GroupSpec(g, [1, 2, 3 + g], n, max_new, seed=7, sampling=SAMPLING, meta={"answer": g}) for g in range(count)
    ]


def lp(tokens: list[int]) -> list[float]:
    """Logprobs exactly representable in float32."""
    return [-t / 4 for t in tokens]


def test_enqueue_is_idempotent_per_step(log):
    assert log.enqueue_step(0, 5, groups(3, 2))
    assert not log.enqueue_step(0, 6, groups(1, 4))
    status = log.step_status(0)
    assert (status.policy_version, status.groups_total, status.queued) == (5, 3, 6)
    assert not status.complete
    with pytest.raises(KeyError, match="no step 1"):
        log.step_status(1)
    with pytest.raises(ValueError, match="duplicate group ids"):
        log.enqueue_step(1, 0, groups(1, 2) + groups(1, 2))
    with pytest.raises(ValueError, match="bad sampling"):
        GroupSpec(0, [1], 2, 8, sampling={"temprature": 1.0})


def test_claim_respects_version_and_returns_request_inputs(log):
    log.enqueue_step(0, 3, groups(1, 2, max_new=6))
    assert log.claim(0, "a", policy_version=2, max_samples=8) == []
    assert log.claim(1, "a", policy_version=3, max_samples=8) == []
    claims = log.claim(0, "a", policy_version=3, max_samples=8)
    assert [c.sample_id for c in claims] == ["0/0/0", "0/0/1"]
    claim = claims[0]
    assert (claim.epoch, claim.prompt_ids, claim.generated_ids) == (1, [1, 2, 3], [])
    request = claim.request(stop_token_ids=(9,))
    assert (request.max_new_tokens, request.seed, request.sampling.temperature) == (6, 7, 1.0)
    assert log.step_status(0).running == 2


def test_claim_prefers_partially_generated_then_enqueue_order(log):
    other = log.shards  # a second group in group 0's shard: the order is a shard's
    log.enqueue_step(0, 0, [GroupSpec(g, [1, 2, 3], 2, 8, sampling=SAMPLING) for g in (0, other)])
    held = {c.sample_id: c for c in log.claim(0, "a", 0, 4)}
    logged = {"0/0/0": 1, "0/0/1": 3, f"0/{other}/0": 0, f"0/{other}/1": 3}
    for sid, count in logged.items():
        tokens = list(range(count))
        assert log.append(sid, "a", held[sid].epoch, tokens, lp(tokens))
    for sid in [f"0/{other}/1", f"0/{other}/0", "0/0/0", "0/0/1"]:
        assert log.release(sid, "a", held[sid].epoch)
    order = [c.sample_id for c in log.claim(0, "b", 0, 4)]
    assert order == [f"0/{other}/1", "0/0/1", "0/0/0", f"0/{other}/0"]


def test_append_is_fenced_and_rejections_counted(log):
    log.enqueue_step(0, 0, groups(1, 2))
    (claim, other) = log.claim(0, "a", 0, 2)
    assert log.append(claim.sample_id, "a", claim.epoch, [4, 5], lp([4, 5]))
    assert not log.append(claim.sample_id, "a", claim.epoch + 1, [6], lp([6]))
    assert not log.append(claim.sample_id, "b", claim.epoch, [6], lp([6]))
    assert not log.append("0/0/9", "a", claim.epoch, [6], lp([6]))
    assert not log.append(claim.sample_id, "a", claim.epoch, list(range(7)), lp(list(range(7))))
    # A rejected flush leaves nothing behind (it is appended, checked, then undone in one script).
    assert log.read_group(0, 0)[0].token_ids == [4, 5] and log.read_group(0, 0)[0].logprobs == lp([4, 5])
    assert not log.append(other.sample_id, "a", other.epoch, [1, 2], lp([1, 2]), offset=3)
    assert log.read_group(0, 0)[1].token_ids == [] and log.step_status(0).tokens_logged == 2
    assert log.reap("a", MAX_REAPS) == 2
    assert not log.append(claim.sample_id, "a", claim.epoch, [6], lp([6]))
    assert not log.finish(claim.sample_id, "a", claim.epoch, [], [], "stop")
    assert log.stats().rejected_appends == 7
    assert log.stats().reaped_samples == 2
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        log.append(claim.sample_id, "a", claim.epoch, [1, 2], [0.0])


def test_finish_completes_group_once_and_streams_it(log, run_id):
    log.enqueue_step(0, 0, groups(2, 2))
    claims = {c.sample_id: c for c in log.claim(0, "a", 0, 4)}

    def finish(sid: str, tokens: list[int]) -> bool:
        return log.finish(sid, "a", claims[sid].epoch, tokens, lp(tokens), "stop")

    assert finish("0/1/0", [7])
    assert log.next_completed_groups(0) == []
    assert finish("0/1/1", [8, 9])
    assert not finish("0/1/1", [8, 9])
    assert log.next_completed_groups(0) == [1]
    assert log.next_completed_groups(0) == []
    records = log.read_group(0, 1)
    assert [r.token_ids for r in records] == [[7], [8, 9]]
    assert [r.logprobs for r in records] == [lp([7]), lp([8, 9])]
    assert records[0].finish_reason == "stop" and records[0].meta == {"answer": 1}
    assert records[0].prompt_ids == [1, 2, 4] and records[0].policy_version == 0

    waiter: list[list[int]] = []
    thread = threading.Thread(target=lambda: waiter.append(log.next_completed_groups(0, 5.0)))
    thread.start()
    assert finish("0/0/0", [1]) and finish("0/0/1", [2])
    thread.join(timeout=10)
    assert waiter == [[0]]
    status = log.step_status(0)
    assert status.complete and status.done == 4 and status.tokens_logged == 5
    # a restarted trainer replays the stream from the start
    replayed = TokenLog(log.client, run_id).next_completed_groups(0)
    assert replayed == [1, 0] if log.shards == 1 else sorted(replayed) == [0, 1]  # in order within a shard


def test_release_keeps_tokens_and_new_owner_resumes_exact_prefix(log):
    log.enqueue_step(0, 0, groups(1, 1, max_new=6))
    (a,) = log.claim(0, "a", 0, 1)
    assert log.log([(a.sample_id, "a", a.epoch, [10, 11], lp([10, 11]))]) == [True]
    assert log.append(a.sample_id, "a", a.epoch, [12], lp([12]), offset=2)
    assert log.release(a.sample_id, "a", a.epoch)
    assert not log.release(a.sample_id, "a", a.epoch)
    (b,) = log.claim(0, "b", 0, 1)
    assert b.epoch > a.epoch
    assert (b.generated_ids, b.generated_logprobs) == ([10, 11, 12], lp([10, 11, 12]))
    assert b.request().generated_ids == [10, 11, 12]
    assert not log.append(a.sample_id, "a", a.epoch, [99], lp([99]))
    assert log.finish(b.sample_id, "b", b.epoch, [13, 14, 15], lp([13, 14, 15]), "length", offset=3)
    (record,) = log.read_group(0, 0)
    assert record.token_ids == [10, 11, 12, 13, 14, 15]
    assert (record.attempts, record.migrations) == (2, 1)
    assert log.stats().migrations == 1


def test_disown_requeues_what_the_log_has_as_running_there_but_the_instance_does_not_hold(log):
    """A Redis that lost its last writes (or a claim whose reply was lost) has samples running on an
    instance that no longer holds them: `disown` hands those back, tokens kept, and nothing else."""
    log.enqueue_step(0, 0, groups(1, 3, max_new=6))
    a, b, c = log.claim(0, "a", 0, 3)
    assert log.append(a.sample_id, "a", a.epoch, [10, 11], lp([10, 11]), offset=0)
    assert log.disown("a", [a.sample_id, b.sample_id, c.sample_id]) == 0
    assert log.disown("a", [b.sample_id]) == 2  # a and c were forgotten
    assert log.disown("a", [b.sample_id]) == 0
    assert not log.append(a.sample_id, "a", a.epoch, [12], lp([12]), offset=2), "the old lease is fenced"
    assert log.append(b.sample_id, "a", b.epoch, [20], lp([20]), offset=0), "what it holds stays its own"
    resumed = {claim.sample_id: claim for claim in log.claim(0, "z", 0, 3)}
    assert set(resumed) == {a.sample_id, c.sample_id}
    assert resumed[a.sample_id].generated_ids == [10, 11]


def test_a_routed_release_waits_for_its_receiver_then_falls_back_to_anyone(log):
    log.enqueue_step(0, 0, groups(1, 3))
    held = {c.sample_id: c for c in log.claim(0, "a", 0, 3)}
    for sid, claim in held.items():
        assert log.append(sid, "a", claim.epoch, [5, 6], lp([5, 6]))
    assert log.release("0/0/0", "a", held["0/0/0"].epoch, to="b", route_s=60)  # a steal for b
    assert log.release("0/0/1", "a", held["0/0/1"].epoch)  # an ordinary release: the shared queue
    assert log.step_status(0).queued == 2
    assert [c.sample_id for c in log.claim(0, "c", 0, 8)] == ["0/0/1"], "c may not take b's sample"
    (routed,) = log.claim(0, "b", 0, 8)
    assert (routed.sample_id, routed.generated_ids) == ("0/0/0", [5, 6])
    assert log.claim(0, "b", 0, 8) == []  # claimed once
    # a receiver that never claims (dead, or no longer claiming): after route_s anyone may
    assert log.release("0/0/2", "a", held["0/0/2"].epoch, to="gone", route_s=0.2)
    taken: list = []
    wait_for(lambda: taken.extend(log.claim(0, "c", 0, 8)) or taken, "the routed sample's wait to end")
    assert [c.sample_id for c in taken] == ["0/0/2"] and taken[0].generated_ids == [5, 6]
    assert log.step_status(0).running == 3
    with pytest.raises(ValueError, match="route to a non-empty instance"):
        log.release("0/0/2", "c", taken[0].epoch, to="", route_s=1)
    log.release("0/0/2", "c", taken[0].epoch, to="b", route_s=60)
    assert log.delete_step(0)
    assert log.step_keys(0) == []  # the routed queue too


def test_reaped_zombie_cannot_touch_migrated_sample(log):
    log.enqueue_step(0, 0, groups(1, 1))
    (zombie,) = log.claim(0, "z", 0, 1)
    assert log.append(zombie.sample_id, "z", zombie.epoch, [1, 2], lp([1, 2]))
    assert log.reap("z", MAX_REAPS) == 1
    (heir,) = log.claim(0, "h", 0, 1)
    assert heir.generated_ids == [1, 2]
    assert not log.append(zombie.sample_id, "z", zombie.epoch, [66], lp([66]))
    assert not log.finish(zombie.sample_id, "z", zombie.epoch, [66], lp([66]), "stop")
    assert not log.release(zombie.sample_id, "z", zombie.epoch)
    assert log.reap("z", MAX_REAPS) == 0
    assert log.finish(heir.sample_id, "h", heir.epoch, [3], lp([3]), "stop")
    assert log.read_group(0, 0)[0].token_ids == [1, 2, 3]
    assert log.next_completed_groups(0) == [0]


def test_token_ids_use_the_full_uint32_range(log):
    log.enqueue_step(0, 0, groups(1, 1))
    (a,) = log.claim(0, "a", 0, 1)
    assert log.finish(a.sample_id, "a", a.epoch, [0, 2**32 - 1], [0.0, -1.5], "stop")
    (record,) = log.read_group(0, 0)
    assert (record.token_ids, record.logprobs) == ([0, 2**32 - 1], [0.0, -1.5])


def test_release_without_tokens_counts_waste(log):
    log.enqueue_step(0, 0, groups(1, 1))
    (a,) = log.claim(0, "a", 0, 1)
    log.append(a.sample_id, "a", a.epoch, [1, 2, 3], lp([1, 2, 3]))
    assert log.release(a.sample_id, "a", a.epoch, keep_tokens=False)
    (b,) = log.claim(0, "b", 0, 1)
    assert b.generated_ids == [] and b.generated_logprobs == []
    assert log.stats().wasted_tokens == 3


def test_redelivered_flushes_and_claims_apply_once(log, monkeypatch):
    log.enqueue_step(0, 0, groups(1, 3))
    monkeypatch.setattr("infra.rollout.tokenlog.secrets.token_hex", lambda n: "fixed-nonce")
    first = log.claim(0, "a", 0, 2)
    assert log.claim(0, "a", 0, 2) == first  # a retried claim returns what it took
    assert log.step_status(0).queued == 1
    monkeypatch.undo()
    sid, epoch = first[0].sample_id, first[0].epoch
    flush = Flush(sid, "a", epoch, [5, 6], lp([5, 6]), offset=0)
    assert log.log([flush, flush]) == [True, True]
    assert not log.append(sid, "a", epoch, [7], lp([7]), offset=1)  # stale offset
    done = Flush(sid, "a", epoch, [7], lp([7]), offset=2, finish_reason="stop")
    assert log.log([done, done]) == [True, True]
    assert log.read_group(0, 0)[0].token_ids == [5, 6, 7]
    assert log.stats().rejected_appends == 1


def test_reaped_too_often_fails_and_drops_group(redis_client, run_id):
    log = TokenLog(redis_client, run_id)
    log.enqueue_step(0, 0, groups(2, 2))
    for _ in range(2):
        for claim in log.claim(0, "a", 0, 4):
            if claim.sample_id != "0/0/0":
                log.release(claim.sample_id, "a", claim.epoch)
        assert log.reap("a", max_reaps=2) == 1
    status = log.step_status(0)
    assert (status.failed, status.groups_dropped, status.dropped_group_ids) == (1, 0, ())
    claims = log.claim(0, "b", 0, 4)
    assert [c.sample_id for c in claims] == ["0/0/1", "0/1/0", "0/1/1"]
    assert log.fail("0/1/0", "b", claims[1].epoch, "prompt too long")
    for claim in (claims[0], claims[2]):
        assert log.finish(claim.sample_id, "b", claim.epoch, [1], lp([1]), "stop")
    status = log.step_status(0)
    assert status.complete and status.dropped_group_ids == (0, 1)
    assert (status.done, status.failed, status.groups_done) == (2, 2, 0)
    assert log.next_completed_groups(0) == []
    assert log.read_group(0, 0)[0].finish_reason == "max_reaps"
    assert log.stats().failed_samples == 2


def test_state_survives_a_new_tokenlog_and_client(log, backend, run_id):
    log.enqueue_step(4, 1, groups(1, 2))
    (a, b) = log.claim(4, "a", 1, 2)
    log.append(a.sample_id, "a", a.epoch, [1], lp([1]))
    fresh = TokenLog(RedisSettings(url=backend[0]).client(), run_id)
    assert fresh.step_status(4) == log.step_status(4)
    assert fresh.release_all("a") == 2
    resumed = {c.sample_id: c for c in fresh.claim(4, "b", 1, 2)}
    assert resumed[a.sample_id].generated_ids == [1]
    for c in resumed.values():
        assert fresh.finish(c.sample_id, "b", c.epoch, [2], lp([2]), "stop")
    assert log.next_completed_groups(4) == [0]
    assert fresh.delete_step(4) and not fresh.delete_step(4)
    assert fresh.step_keys(4) == []


def test_what_others_read_comes_from_methods_not_keys(log):
    log.enqueue_step(0, 0, groups(1, 3, max_new=6))
    log.enqueue_step(1, 0, groups(1, 1))
    held = {c.sample_id: c for c in log.claim([0, 1], "a", 0, 8)}
    assert log.running("a") == {"0/0/0", "0/0/1", "0/0/2", "1/0/0"}
    assert log.append("0/0/0", "a", held["0/0/0"].epoch, [5, 6], lp([5, 6]))
    assert log.append("0/0/1", "a", held["0/0/1"].epoch, [7], lp([7]))
    assert log.release("0/0/1", "a", held["0/0/1"].epoch)  # queued with one logged token
    leases = log.step_leases(0, ["a", "nobody"])
    assert leases.running == {"a": [RunningLease("0/0/0", 2, 6, 0), RunningLease("0/0/2", 0, 6, 0)], "nobody": []}
    assert leases.queued_partial == 1 == log.queued_partial(0) and log.queued_partial(1) == 0
    assert log.sample_owners(["0/0/0", "0/0/1", "9/9/9"]) == ["a", "", ""]
    (again,) = log.claim(0, "b", 0, 1)
    for claim, owner in [(held["0/0/0"], "a"), (held["0/0/2"], "a"), (held["1/0/0"], "a"), (again, "b")]:
        assert log.finish(claim.sample_id, owner, claim.epoch, [1], lp([1]), "stop")
    assert log.completions(0) == 1 == log.completions(1) and log.running("a") == set()
    assert log.sample_owners(["0/0/1"]) == ["b"], "a done sample keeps its last owner"
    kinds = {key.split("}:", 1)[1].split(":")[0] for key in log.step_keys(0)}
    assert kinds == {"step", "groups", "g", "s", "done"} and "s:1/0/0" not in str(log.step_keys(0))
    assert log.delete_step(0) and log.step_keys(0) == [] and log.step_keys(1)


def test_rejects_decoding_client_and_bad_run_id(redis_url, redis_client):
    with pytest.raises(ValueError, match="decode_responses=False"):
        TokenLog(redis.Redis.from_url(redis_url, decode_responses=True), "r")
    with pytest.raises(ValueError, match="braces"):
        TokenLog(redis_client, "a{b}")


# --- randomized interleavings against a reference model --------------------------------------


@dataclass
class ModelSample:
    max_new: int
    state: str = "queued"
    owner: str = ""
    epoch: int = 0
    attempts: int = 0
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    priority: tuple[int, int] = (0, 0)
    prefixes: list[list[int]] = field(default_factory=list)
    """Every token sequence ever successfully logged (reset when tokens are discarded)."""


@dataclass
class Lease:
    epoch: int
    tokens: list[int]


class Model:
    """The token log's semantics, in plain Python."""

    def __init__(self, specs: list[GroupSpec]) -> None:
        self.samples: dict[str, ModelSample] = {}
        self.seq = 0
        for g in specs:
            for i in range(g.n):
                self.seq += 1
                sid = f"0/{g.group_id}/{i}"
                self.samples[sid] = ModelSample(g.max_new_tokens, priority=(0, self.seq))
        self.rejected = self.wasted = self.migrations = 0

    def claim(self, instance: str, k: int) -> list[str]:
        queued = sorted((s.priority, sid) for sid, s in self.samples.items() if s.state == "queued")
        taken = [sid for _, sid in queued[:k]]
        for sid in taken:
            s = self.samples[sid]
            s.attempts += 1
            self.migrations += s.attempts > 1
            s.state, s.owner, s.epoch = "running", instance, s.epoch + 1
        return taken

    def log(self, f: Flush) -> bool:
        s = self.samples[f.sample_id]
        have, new = len(s.tokens), list(f.token_ids)
        at = have if f.offset is None else f.offset
        ok = False
        if s.owner == f.instance_id and s.epoch == f.epoch:
            if s.state == "running" and at == have and have + len(new) <= s.max_new:
                s.tokens += new
                s.prefixes.append(list(s.tokens))
                if f.finish_reason:
                    s.state, s.finish = "done", f.finish_reason
                ok = True
            elif (
                f.offset is not None
                and at + len(new) == have
                and s.tokens[at:] == new
                and (
                    (s.state == "running" and not f.finish_reason)
                    or (s.state == "done" and f.finish_reason == s.finish)
                )
            ):
                ok = True
        self.rejected += not ok
        return ok

    def requeue(self, sid: str, keep: bool) -> None:
        s = self.samples[sid]
        s.state, s.owner, s.epoch = "queued", "", s.epoch + 1
        if not keep:
            self.wasted += len(s.tokens)
            s.tokens, s.prefixes = [], []
        self.seq += 1
        s.priority = (-len(s.tokens), self.seq)

    def release(self, sid: str, instance: str, epoch: int, keep: bool) -> bool:
        s = self.samples[sid]
        if s.state != "running" or s.owner != instance or s.epoch != epoch:
            return False
        self.requeue(sid, keep)
        return True

    def release_all(self, instance: str) -> int:
        owned = sorted(sid for sid, s in self.samples.items() if s.state == "running" and s.owner == instance)
        for sid in owned:
            self.requeue(sid, keep=True)
        return len(owned)


def _random_run(redis_client: redis.Redis, seed: int, ops: int) -> None:
    rng = random.Random(seed)
    run_id = f"fuzz-{seed}-{uuid.uuid4().hex[:6]}"
    specs = [GroupSpec(g, [1 + g], rng.randint(1, 4), rng.randint(4, 40)) for g in range(40)]
    log = TokenLog(redis_client, run_id)
    log.enqueue_step(0, 0, specs)
    model = Model(specs)
    instances = [f"i{k}" for k in range(4)]
    leases: dict[str, dict[str, Lease]] = {i: {} for i in instances}
    stale: list[tuple[str, str, Lease]] = []  # dropped leases whose flushes may arrive late

    def drop(instance: str, sid: str) -> None:
        stale.append((instance, sid, leases[instance].pop(sid)))

    def flush(instance: str, sid: str, finish: bool) -> None:
        lease = leases[instance][sid]
        budget = model.samples[sid].max_new - len(lease.tokens)
        count = rng.randint(0, max(0, budget)) if finish else rng.randint(1, 3)
        if rng.random() < 0.05:
            count = budget + 1  # over budget: rejected
        new = [rng.randrange(1 << 24) for _ in range(count)]  # float32-exact logprobs
        offset = len(lease.tokens) if rng.random() < 0.7 else None
        reason = rng.choice(["stop", "length"]) if finish else None
        f = Flush(sid, instance, lease.epoch, new, lp(new), offset, reason)
        deliveries = 2 if offset is not None and rng.random() < 0.2 else 1  # a retried send
        for _ in range(deliveries):
            expected = model.log(f)
            assert log.log([f]) == [expected], (seed, f)
        if expected:
            lease.tokens += new
        if not expected or finish:
            drop(instance, sid)

    for op in range(ops):
        if op % 400 == 399:  # a restarted process: same Redis, new objects
            client = redis.Redis(connection_pool=redis_client.connection_pool)
            log = TokenLog(client, run_id)
        instance = rng.choice(instances)
        held = leases[instance]
        roll = rng.random()
        if roll < 0.2:
            k = rng.randint(1, 4)
            claims = log.claim(0, instance, 0, k)
            assert [c.sample_id for c in claims] == model.claim(instance, k), seed
            for c in claims:
                assert c.generated_ids == model.samples[c.sample_id].tokens
                if c.sample_id in held:
                    drop(instance, c.sample_id)
                held[c.sample_id] = Lease(c.epoch, list(c.generated_ids))
        elif roll < 0.6 and held:
            flush(instance, rng.choice(sorted(held)), finish=False)
        elif roll < 0.68 and held:
            flush(instance, rng.choice(sorted(held)), finish=True)
        elif roll < 0.85 and held:
            sid = rng.choice(sorted(held))
            keep = rng.random() < 0.8
            lease = held[sid]
            drop(instance, sid)
            expected = model.release(sid, instance, lease.epoch, keep)
            assert log.release(sid, instance, lease.epoch, keep_tokens=keep) == expected
        elif roll < 0.93:
            # reap: the instance is declared dead but keeps its stale leases (a zombie)
            assert log.reap(instance, max_reaps=10**6) == model.release_all(instance)
        elif roll < 0.95:
            assert log.release_all(instance) == model.release_all(instance)
            for sid in sorted(held):
                drop(instance, sid)
        elif roll < 0.97 and stale:
            # a flush of a lease that was dropped (released, revoked, replaced) arrives late
            late, sid, lease = stale[rng.randrange(len(stale))]
            new = [rng.randrange(1000)]
            f = Flush(sid, late, lease.epoch, new, lp(new), rng.choice([None, len(lease.tokens)]))
            assert log.log([f]) == [model.log(f)], (seed, f)
        elif held:
            # a `log` batch over every lease the instance holds
            batch = []
            for sid, lease in sorted(held.items()):
                new = [rng.randrange(1000) for _ in range(rng.randint(1, 2))]
                batch.append(Flush(sid, instance, lease.epoch, new, lp(new), len(lease.tokens)))
            expected = [model.log(f) for f in batch]
            assert log.log(batch) == expected, seed
            for f, ok in zip(batch, expected):
                if ok:
                    held[f.sample_id].tokens += list(f.token_ids)
                else:
                    drop(instance, f.sample_id)

    # drain: a fresh instance finishes everything that is left
    for i in instances:
        assert log.release_all(i) == model.release_all(i)
    while claims := log.claim(0, "drain", 0, 64):
        assert [c.sample_id for c in claims] == model.claim("drain", len(claims))
        flushes = [Flush(c.sample_id, "drain", c.epoch, [], [], len(c.generated_ids), "stop") for c in claims]
        assert log.log(flushes) == [model.log(f) for f in flushes]

    status = log.step_status(0)
    assert status.complete and status.done == len(model.samples)
    assert status.groups_done == len(specs)
    assert status.tokens_logged == sum(len(s.tokens) for s in model.samples.values())
    streamed = TokenLog(redis_client, run_id).next_completed_groups(0)
    assert sorted(streamed) == list(range(len(specs)))  # every group exactly once
    for g in specs:
        for record in log.read_group(0, g.group_id):
            sample = model.samples[record.sample_id]
            assert record.state == "done" and record.token_ids == sample.tokens
            assert record.logprobs == lp(sample.tokens)
            assert all(record.token_ids[: len(p)] == p for p in sample.prefixes)
            assert record.attempts == sample.attempts
    stats = log.stats()
    assert (stats.rejected_appends, stats.wasted_tokens, stats.migrations) == (
        model.rejected,
        model.wasted,
        model.migrations,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleavings_lose_and_duplicate_nothing(redis_client, seed):
    _random_run(redis_client, seed, ops=2000)


def test_a_run_keeps_its_shard_count_and_another_is_refused_with_one_line(redis_client, run_id):
    from infra.cli.failures import ending
    from infra.rollout.protocol import set_current_step

    assert TokenLog(redis_client, run_id).shards == 1, "a run with no recorded count has one shard"
    assert TokenLog(redis_client, run_id, shards=3).shards == 3 == TokenLog(redis_client, run_id).shards
    with pytest.raises(ShardCountMismatch) as refused:
        TokenLog(redis_client, run_id, shards=1)
    line = ending(refused.value, "")
    assert line is not None and line.code == 2
    assert (
        line.line
        == f"cannot run: run '{run_id}''s token log has 3 shards, not 1: set fabric.tokenlog_shards to 3 to resume it"
    )
    before = f"{run_id}-old"  # a run started before shards: no count recorded, a current step
    assert set_current_step(redis_client, before, 4, 4)
    with pytest.raises(ShardCountMismatch, match="has 1 shard, not 2: set fabric.tokenlog_shards to 1"):
        TokenLog(redis_client, before, shards=2)
    assert TokenLog(redis_client, before, shards=1).prefix == f"rlb:{{{before}}}:", "its keys as they were"
