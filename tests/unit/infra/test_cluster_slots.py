"""Redis Cluster slot design (:mod:`infra.keys`): every Lua script's KEYS, and every MULTI/EXEC,
hash to one slot, for farm ids as submission makes them. No server: the slot is redis-py's
CRC16 of the hash tag (``redis.crc.key_slot``), the function Redis Cluster itself uses."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from infra import keys
from infra.state.connect import is_cluster_url, state_client
from infra.state.job_store import JobStore
from infra.submission.submitter import new_id


def slots(names) -> set[int]:
    return {key_slot(name.encode()) for name in names}


def farm_batch(idempotency: tuple[str, str] | None = None, n: int = 20) -> tuple[str, list[str]]:
    """A batch id and its job ids, made as :meth:`infra.submission.submitter.Submitter.submit` makes them."""
    batch_id = new_id(keys.idempotency_shard(*idempotency) if idempotency else None)
    return batch_id, [new_id(keys.shard(batch_id)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_transition_scripts_touch_one_slot(seed):
    batch_id, job_ids = farm_batch()
    store = JobStore.__new__(JobStore)  # _keys needs no connection when owners are given
    store._cluster = True
    for job_id in job_ids:
        names = store._keys(job_id, batch_id, f"tenant{seed}")
        assert len(names) == 9 and len(slots(names)) == 1, names


@pytest.mark.parametrize("seed", range(10))
def test_a_group_script_call_touches_one_slot(seed):
    """A worker's group mixes batches of several shards: each group script call is one slot."""
    store = JobStore.__new__(JobStore)
    store._cluster = True
    jobs = [(job_id, batch_id, f"tenant{seed}-{n}") for n in range(4)
            for batch_id, job_ids in [farm_batch(n=8)] for job_id in job_ids]
    groups = store._shard_groups(jobs)
    assert sorted(j for group, _ in groups for j, _, _ in group) == sorted(j for j, _, _ in jobs)
    for group, names in groups:
        assert len(names) == 9 * len(group) and len(slots(names)) == 1, names


@pytest.mark.parametrize("seed", range(20))
def test_a_batch_transaction_is_one_slot_with_its_idempotency_key(seed):
    tenant, key = f"t{seed}", f"client-key-{seed}"
    batch_id, job_ids = farm_batch((tenant, key))
    s = keys.shard(batch_id)
    names = [keys.batch(batch_id), keys.batch_counts(batch_id), keys.batch_jobs(batch_id),
             *map(keys.job, job_ids), keys.pending(s), keys.recent_batches(tenant, s), keys.idempotency(tenant, key)]
    assert len(slots(names)) == 1


def test_farm_ids_keep_their_shape_and_spread_over_every_shard():
    ids = [new_id() for _ in range(4000)]
    assert all(len(i) == 32 and i.isalnum() and i == i.lower() for i in ids)
    assert {keys.shard(i) for i in ids} == set(keys.SHARDS)
    assert len(slots(keys.leases(s) for s in keys.SHARDS)) == len(keys.SHARDS)  # 256 slots, spread by CRC16
    assert keys.shard("b1") in keys.SHARDS and keys.shard("AB12") in keys.SHARDS  # hand-written ids map too


def test_pool_workers_metrics_and_api_keys_share_their_tags():
    pool = "sd15-a100"
    assert len(slots([keys.lanes(pool), keys.wfq(pool), keys.popped(pool), keys.lane(pool, "alice:high"),
                      keys.lane(pool, "bob:low")])) == 1
    assert len(slots([keys.WORKERS, keys.worker("w1"), keys.worker("w2")])) == 1
    assert len(slots([keys.METRICS_POOLS, keys.metrics("a"), keys.metrics("b"), keys.pool_throughput("a", 7),
                      keys.worker_throughput("w", 8)])) == 1
    assert len(slots([keys.API_KEYS, keys.api_key("ff" * 32), keys.tenant_keys("alice")])) == 1


def test_no_script_names_a_key_of_its_own():
    """A script that built key names from ARGV would touch keys Redis Cluster cannot route."""
    from infra.broker import dispatch
    from infra.state import group_scripts, scripts

    bodies = [getattr(scripts, n) for n in ("CREATE", "START", "FINISH", "REQUEUE", "RELEASE", "RETRY")]
    bodies += [group_scripts.START, group_scripts.TOUCH, group_scripts.SUCCEED]
    for body in [*bodies, dispatch._DISPATCH]:
        assert keys.PREFIX + "job" not in body
    assert "job_prefix" not in dispatch._DISPATCH


def test_cluster_urls():
    assert is_cluster_url("redis+cluster://127.0.0.1:7000") and is_cluster_url("rediss+cluster://h:1/0")
    assert not is_cluster_url("redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="database"):
        state_client("redis+cluster://127.0.0.1:7000/3")
