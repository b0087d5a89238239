"""Ray batch workers: ranks split the groups without overlap, each batch on the rank's device."""

from __future__ import annotations

from trajbus.consumers.gpu_worker import make_batch_workers, rank_of
from trajbus.pipelines.synthetic import make_groups
from tests.helpers import through_worker


def test_two_ranks_split_groups_without_overlap(bootstrap_servers, prefix, start_worker, local_ray):
    ray = local_ray
    sent, stream = make_groups(12, 2, 1, seed=3)
    through_worker(bootstrap_servers, prefix, start_worker, stream, n_rollouts=2)
    per_rank = {r: sum(1 for uid in sent if rank_of(uid, 2) == r) for r in (0, 1)}
    assert all(per_rank.values()), "the seed must give both ranks work"
    workers = make_batch_workers(2, {"prompt_length": 16, "response_length": 8},
                                 bootstrap_servers=bootstrap_servers, prefix=prefix)
    batches = ray.get([w.next_batch.remote(per_rank[r], 60) for r, w in enumerate(workers)])
    uids = [set(batch.non_tensor_batch["uid"]) for batch in batches]
    assert uids[0].isdisjoint(uids[1]) and uids[0] | uids[1] == set(sent)
    assert all(rank_of(uid, 2) == r for r, ranked in enumerate(uids) for uid in ranked)
    import torch

    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert [str(batch.batch[key].device) for batch in batches for key in batch.batch.keys()] == \
        [expected] * sum(len(batch.batch.keys()) for batch in batches), f"every tensor on {expected}"
    ray.get([w.close.remote() for w in workers])
