"""Node-aware placement (balancer/node_placement.py) and the locality measures (balancer/locality.py): valid
plans, replicas spread over nodes, balance at the target, and fewer cross-node rows than a plan that ignores
nodes on tokens routed DeepSeek's group-limited way. The comparison with EPLB is scripts/bench_node_placement.py."""

import pytest
import torch

from moe_serve.balancer import rebalance_experts, validate_plan
from moe_serve.balancer.eplb import _pack_candidates
from moe_serve.balancer.locality import (coactivation, node_counts, node_local_balancedness, node_local_gpu_loads,
                                         node_local_view, remote_nodes_per_token, replica_loads)
from moe_serve.balancer.placement import build_log2phy

E, GROUPS, TOPK_GROUP, K = 64, 8, 4, 6


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def routed_tokens(num_layers: int, num_tokens: int, s: float, seed: int) -> list[torch.Tensor]:
    """topk_ids per layer, routed group-limited (best TOPK_GROUP groups by their top-2 scores, then top K)
    from scores log(Zipf share) + Gumbel noise."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_layers):
        share = (torch.arange(1, E + 1, dtype=torch.float64) ** -s)[torch.randperm(E, generator=gen)]
        score = share.log() - (-torch.rand(num_tokens, E, generator=gen, dtype=torch.float64).log()).log()
        grouped = score.view(num_tokens, GROUPS, -1)
        keep = torch.zeros(num_tokens, GROUPS, dtype=torch.bool).scatter_(
            1, grouped.topk(2, dim=2).values.sum(2).topk(TOPK_GROUP, dim=1).indices, True)
        out.append(grouped.masked_fill(~keep.unsqueeze(2), -float("inf")).view(num_tokens, E).topk(K, dim=1).indices)
    return out


def test_measures_on_a_hand_example():
    # 2 nodes x 2 GPUs x 2 slots; expert 0 on both nodes, experts 1..3 once, expert 4 once... 8 slots, 6 experts.
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 4, 5, 5]])
    counts = node_counts(phy2log, 6, 4, 2)[0]
    assert counts[0].tolist() == [1, 1] and counts[5].tolist() == [0, 2] and counts[1].tolist() == [1, 0]
    weight = torch.tensor([[8.0, 1, 1, 1, 1, 4]])
    # expert 0: each node serves its own half locally: 4 per replica; expert 5: both replicas on node 1 take all.
    assert node_local_gpu_loads(weight, phy2log, 4, 2)[0].tolist() == [5.0, 2.0, 5.0, 4.0]
    assert node_local_balancedness(weight, phy2log, 4, 2).item() == pytest.approx(4.0 / 5.0)
    # token 0 on node 0 wants experts 0 (local) and 4 (node 1): one remote node; token 1 on node 1 wants 1 and 2.
    ids = torch.tensor([[0, 4], [1, 2]])
    assert remote_nodes_per_token(ids, torch.tensor([0, 1]), phy2log[0], 4, 2).tolist() == [1, 1]
    # without the node-local rule token 0 takes replica 0 % 2 of expert 0, on node 0 too; token 1 % 2 = slot 4...
    assert remote_nodes_per_token(torch.tensor([[0, 1], [0, 1]]), torch.tensor([1, 1]), phy2log[0], 4, 2,
                                  node_local=False).tolist() == [1, 1]


def test_node_local_view_keeps_only_local_replicas_where_there_are_some():
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 4, 5, 5]])
    log2phy, logcnt = build_log2phy(phy2log, 6)
    view, cnt = node_local_view(log2phy[0], logcnt[0], slots_per_rank=2, rank_nodes=(0, 0, 1, 1), node=1)  # 4..7
    assert cnt.tolist() == [1, 1, 1, 1, 1, 2]
    assert view[0, 0] == 4 and view[5, :2].tolist() == [6, 7] and view[1, 0] == 1  # expert 1 only on node 0


def test_tokens_without_a_local_replica_go_to_the_experts_home_node():
    # 3 nodes x 1 GPU x 4 slots. Expert 0: 2 replicas on node 0 (its home) and a copy on node 1; expert 1: one
    # replica on nodes 1 and 2 each (no home: an even split); the rest once.
    phy2log = torch.tensor([[0, 0, 2, 3, 0, 1, 4, 5, 1, 6, 7, 8]])
    weight = torch.tensor([[6.0, 6, 1, 1, 1, 1, 1, 1, 1]])
    per = replica_loads(weight, node_counts(phy2log, 9, 3, 3))[0]
    # expert 0: node 0's own 2 and node 2's 2 over its 2 home replicas; node 1's 2 on the copy there
    assert per[0].tolist() == pytest.approx([2.0, 2.0, 0.0])
    assert per[1].tolist() == pytest.approx([0.0, 3.0, 3.0])  # node 0's 2 split evenly over both
    # token 0 on node 2 wants expert 0: home (node 0), not the copy on node 1; token 1 on node 1 uses the copy
    ids = torch.tensor([[0, 2], [0, 5]])
    assert remote_nodes_per_token(ids, torch.tensor([2, 1]), phy2log[0], 3, 3).tolist() == [1, 0]
    log2phy, logcnt = build_log2phy(phy2log, 9)
    view, cnt = node_local_view(log2phy[0], logcnt[0], slots_per_rank=4, rank_nodes=(0, 1, 2), node=2)
    assert cnt[0] == 2 and sorted(view[0, :2].tolist()) == [0, 1]  # only the home replicas
    assert cnt[1] == 1 and view[1, 0] == 8  # its own node's
    view, cnt = node_local_view(log2phy[0], logcnt[0], slots_per_rank=4, rank_nodes=(0, 1, 2), node=0)
    assert cnt[1] == 2 and sorted(view[1, :2].tolist()) == [5, 8]  # no home: all of its replicas


def test_coactivation_counts_pairs_of_one_token():
    ids = torch.tensor([[0, 1, 2], [1, 2, 3]])
    co = coactivation(ids, 4)
    assert co[1, 2] == 2 and co[2, 1] == 2 and co[0, 3] == 0 and co[0, 1] == 1 and co.diagonal().sum() == 0


@pytest.mark.parametrize("num_slots,num_gpus,num_nodes", [(80, 16, 4), (96, 16, 2), (64, 16, 4)])
@pytest.mark.parametrize("s", [0.0, 1.0])
def test_plan_valid_spread_balanced_and_local(num_slots, num_gpus, num_nodes, s):
    tokens = routed_tokens(4, 3000, s, seed=int(s * 10) + num_nodes)
    weight = torch.stack([torch.bincount(t.flatten(), minlength=E) for t in tokens]).double()
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_slots, GROUPS, num_nodes, num_gpus)
    validate_plan(phy2log, log2phy, logcnt, E)
    counts = node_counts(phy2log, E, num_gpus, num_nodes)
    present = (counts > 0).sum(2)
    # an expert has all its replicas on one node, or on distinct nodes, or at least one on every node
    assert ((present == 1) | (present == logcnt) | (present == num_nodes)).all()
    # balance: no worse than EPLB's global policy (our packing candidate 1) minus 0.01, under the node-local rule,
    # in the mean over layers; a layer may spend the others' room down to 0.05 below its own target
    _, top = _pack_candidates(weight.double(), num_slots, num_gpus, None)
    target = weight.sum(1) / num_gpus / top[min(1, len(top) - 1)] - 0.01
    balance = node_local_balancedness(weight, phy2log, num_gpus, num_nodes)
    assert balance.mean() >= target.mean() - 1e-9 and (balance >= target - 0.05 - 1e-9).all()
    # locality: fewer remote nodes per token than the same deployment planned for one node
    flat = rebalance_experts(weight, num_slots, GROUPS, 1, num_gpus)[0]
    fresh = routed_tokens(4, 2000, s, seed=99)
    src = torch.arange(2000) % num_nodes
    ours = torch.stack([remote_nodes_per_token(t, src, p, num_gpus, num_nodes).double().mean() for t, p in zip(fresh, phy2log)])
    blind = torch.stack([remote_nodes_per_token(t, src, p, num_gpus, num_nodes).double().mean() for t, p in zip(fresh, flat)])
    assert ours.mean() < 0.97 * blind.mean(), (ours.tolist(), blind.tolist())


def test_previous_with_the_same_load_moves_nothing_across_nodes():
    weight = torch.stack([torch.bincount(t.flatten(), minlength=E) for t in routed_tokens(3, 3000, 1.0, 5)]).double()
    plan = rebalance_experts(weight, 80, GROUPS, 4, 16)[0]
    again = rebalance_experts(weight, 80, GROUPS, 4, 16, previous=plan)[0]
    assert torch.equal(plan, again)


def test_coactivation_must_match_the_load():
    weight = torch.ones(2, E)
    with pytest.raises(ValueError, match="coactivation must be"):
        rebalance_experts(weight, 80, GROUPS, 4, 16, coactivation=torch.zeros(2, E, E - 1))


def test_replica_chooser_on_a_node_local_view_stays_on_the_node():
    from moe_serve.balancer.placement import ReplicaChooser

    phy2log = torch.tensor([[0, 1, 2, 3, 0, 4, 5, 5]])  # 4 ranks x 2 slots; ranks 2, 3 on node 1
    log2phy, logcnt = build_log2phy(phy2log, 6)
    view, cnt = node_local_view(log2phy[0], logcnt[0], slots_per_rank=2, rank_nodes=(0, 0, 1, 1), node=1)
    chosen = ReplicaChooser(view, cnt, 4, slots_per_rank=2)(torch.tensor([[0, 5], [0, 5], [1, 5], [0, 2]]))
    assert chosen[:, 0].tolist() == [4, 4, 1, 4]  # expert 0 on node 1's slot 4; expert 1 only on node 0
    assert set(chosen[:3, 1].tolist()) <= {6, 7} and chosen[3, 1] == 2


def test_moe_plan_reports_cross_node_rows_on_several_nodes():
    from moe_serve.balancer.placement_file import format_what_if, what_if

    weight = torch.stack([torch.bincount(t.flatten(), minlength=E) for t in routed_tokens(2, 2000, 1.0, 3)]).double()
    report = what_if(weight, 16, 16, num_nodes=4, num_groups=GROUPS, topk=K, topk_group=TOPK_GROUP, token_bytes=1024,
                     sample_tokens=1000)
    rows = report["cross_node_rows_per_token"]
    assert set(rows) == {"no_replication", "planned"} and all(0 < v <= 3 for v in rows.values())
    assert min(report["balancedness_planned"]) > max(report["balancedness_no_replication"])
    assert "cross-node rows per token" in format_what_if(report) and "KiB" in format_what_if(report)
    with pytest.raises(ValueError, match="3 nodes must divide the 16 EP ranks"):
        what_if(weight, 16, 16, num_nodes=3)


def test_grouped_layout_copies_across_nodes_to_reach_a_node_cap():
    from moe_serve.balancer.grouped_layout import grouped_counts

    weight = torch.ones(E, dtype=torch.float64)
    weight[:8] = 1.3  # group 0 is the heaviest: one node above the cap
    for slots_per_node, nodes in ((10, 8), (16, 4), (20, 4)):
        anchor = grouped_counts(weight, GROUPS, nodes, slots_per_node)
        assert ((anchor > 0).sum(1) == 1).all()  # whole groups on nodes: nothing split
        cap = float(weight.sum()) / nodes * 1.05
        count = grouped_counts(weight, GROUPS, nodes, slots_per_node, cap)
        assert (count.sum(0) == slots_per_node).all() and (count.sum(1) >= 1).all()
        load = (replica_loads(weight.view(1, -1), count.unsqueeze(0))[0] * count).sum(0)
        assert load.max() <= cap + 1e-9, (slots_per_node, nodes, load.tolist())
        if slots_per_node == E // nodes:  # no spare slots, so no copies: a few experts swap nodes
            assert ((count > 0) != (anchor > 0)).any(1).sum() <= 8
            continue
        assert (count[anchor > 0] > 0).all()  # copies only: every expert still on its group's node...
        home = count.argmax(1)
        copied = (count > 0).sum(1) > 1
        assert copied.any() and (count[copied].gather(1, home[copied].view(-1, 1)) >= 2).all()
        others = count.scatter(1, home.view(-1, 1), 0).amax(1)  # ...and that node its home
        assert (count.gather(1, home.view(-1, 1)).squeeze(1) > others)[copied].all()
    # groups used together (0 with 1, 2 with 3, ...) share a node when the cap allows it
    together = torch.eye(GROUPS) * 0.5
    for g in range(0, GROUPS, 2):
        together[g, g + 1] = together[g + 1, g] = 0.4
    node_of_group = grouped_counts(torch.ones(E), GROUPS, 4, 16, float("inf"), together).argmax(1)[::E // GROUPS]
    assert all(node_of_group[g] == node_of_group[g + 1] for g in range(0, GROUPS, 2))


def test_balance_repairs_keep_the_experts_and_reach_the_target():
    from moe_serve.balancer.node_swaps import regroup_gpus, swap_to_target

    # 2 nodes x 2 GPUs x 2 slots; GPU 0 holds the two heavy experts: a swap (across nodes, as none within helps)
    weight = torch.tensor([4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    plan = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    fixed = swap_to_target(plan, weight, 4, 2, target=0.7)  # at best 3.5 / (4 + 1)
    assert sorted(fixed.tolist()) == list(range(8))
    assert node_local_balancedness(weight.view(1, -1), fixed.view(1, -1), 4, 2).item() == pytest.approx(0.7)
    # expert 0's two replicas on GPUs 0 and 1 (node 0): node 1's tokens split over both, node 0's too; an expert
    # with replicas on one node only is as balanced as an even split, so trading GPUs keeps the GPUs' contents
    plan = torch.tensor([0, 1, 0, 2, 3, 4, 5, 6])
    weight = torch.tensor([8.0, 1, 1, 1, 1, 1, 1])
    traded = regroup_gpus(plan, weight, 4, 2, target=1.0)
    assert sorted(map(tuple, traded.view(4, 2).sort(1).values.tolist())) == sorted(
        map(tuple, plan.view(4, 2).sort(1).values.tolist()))
    before = node_local_balancedness(weight.view(1, -1), plan.view(1, -1), 4, 2).item()
    assert node_local_balancedness(weight.view(1, -1), traded.view(1, -1), 4, 2).item() >= before
