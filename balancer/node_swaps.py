"""Balance repair that spends as little locality as it can: swaps of two slots' experts that lower the busiest
GPU, preferring those within a node (free), then those across nodes that move the least load off its node.

A plan that keeps experts near their partners (balancer/node_placement.py, balancer/grouped_layout.py) can
miss the balance target by a little: the busiest GPU carries a slot or two too much. A swap across nodes
sends the tokens of both swapped replicas elsewhere, so its locality cost is taken as the load those two
replicas carry; a swap within a node costs none. Per step, on the busiest GPU:
  - among swaps that bring both GPUs they change to the limit (mean GPU load / target), the cheapest;
  - else the swap that lowers the busiest GPU most (ties: the cheaper);
loads under the node-local rule (balancer/locality.py), recomputed after each swap.

Shape legend: E experts, R slots, G GPUs, S = R // G slots per GPU, C candidate partner slots.
"""

import torch

from moe_serve.balancer.locality import node_counts, node_local_gpu_loads, node_of_slot, replica_loads

_MAX_SWAPS = 16  # per layer


def swap_to_target(phy2log_R: torch.Tensor, weight_E: torch.Tensor, num_gpus: int, num_nodes: int, target: float
                   ) -> torch.Tensor:
    """phy2log_R after swaps (above) until its balancedness reaches `target`; else the best balanced plan the
    swaps passed through (when no swap lowers the busiest GPU, or after _MAX_SWAPS)."""
    plan_R = phy2log_R.clone()
    num_slots, num_logical = plan_R.shape[0], weight_E.shape[0]
    per_gpu = num_slots // num_gpus
    node_R = node_of_slot(num_slots, num_gpus, num_nodes)
    gpu_R = torch.arange(num_slots) // per_gpu
    weight_1E = weight_E.double().view(1, -1)
    inf = float("inf")
    best_R, best = plan_R.clone(), -1.0
    for _ in range(_MAX_SWAPS + 1):
        count_EN = node_counts(plan_R.view(1, -1), num_logical, num_gpus, num_nodes)
        load_R = replica_loads(weight_1E, count_EN)[0][plan_R, node_R]
        load_G = load_R.view(num_gpus, per_gpu).sum(1)
        top, hot = load_G.max(0)
        if top <= 0 or load_G.mean() >= target * top:
            return plan_R
        if load_G.mean() / top > best:
            best_R, best = plan_R.clone(), float(load_G.mean() / top)
        limit = float(load_G.mean()) / max(target, 1e-9)
        a_S = torch.arange(int(hot) * per_gpu, (int(hot) + 1) * per_gpu)
        b_C = (gpu_R != hot).nonzero().flatten()
        d_SC = load_R[a_S].unsqueeze(1) - load_R[b_C].unsqueeze(0)
        after_SC = torch.maximum(top - d_SC, load_G[gpu_R[b_C]].unsqueeze(0) + d_SC)
        ok_SC = (d_SC > 0) & (after_SC < top * (1 - 1e-9))
        ok_SC &= plan_R[a_S].unsqueeze(1) != plan_R[b_C].unsqueeze(0)
        across_SC = node_R[a_S].unsqueeze(1) != node_R[b_C].unsqueeze(0)
        cost_SC = torch.where(across_SC, load_R[a_S].unsqueeze(1) + load_R[b_C].unsqueeze(0), 0.0)
        reach_SC = ok_SC & (after_SC <= limit)
        if reach_SC.any():
            key_SC = cost_SC.masked_fill(~reach_SC, inf)
        elif ok_SC.any():
            key_SC = (after_SC + 1e-6 * cost_SC).masked_fill(~ok_SC, inf)
        else:
            break
        s, c = divmod(int(key_SC.argmin()), len(b_C))
        a, b = int(a_S[s]), int(b_C[c])
        plan_R[a], plan_R[b] = plan_R[b].clone(), plan_R[a].clone()
    return best_R


def regroup_gpus(phy2log_R: torch.Tensor, weight_E: torch.Tensor, num_gpus: int, num_nodes: int, target: float
                 ) -> torch.Tensor:
    """phy2log_R with whole GPUs traded between nodes (each keeps its experts) while that lowers the busiest GPU
    under the node-local rule, until the balancedness reaches `target`. For a plan packed without regard to
    nodes: it is as balanced under the node-local rule as under the even split when each expert's replicas
    sit evenly on the nodes that hold it (as many on each), which trading GPUs can approach."""
    per_gpu = phy2log_R.shape[0] // num_gpus
    plan_GS = phy2log_R.view(num_gpus, per_gpu).clone()
    node_G = torch.arange(num_gpus) // (num_gpus // num_nodes)
    weight_1E = weight_E.double().view(1, -1)
    for _ in range(2 * num_gpus):
        load_G = node_local_gpu_loads(weight_1E, plan_GS.view(1, -1), num_gpus, num_nodes)[0]
        top, hot = load_G.max(0)
        if top <= 0 or load_G.mean() >= target * top:
            break
        other_J = (node_G != node_G[hot]).nonzero().flatten()
        trial_JGS = plan_GS.unsqueeze(0).repeat(len(other_J), 1, 1)
        trial_JGS[torch.arange(len(other_J)), hot] = plan_GS[other_J]
        trial_JGS[torch.arange(len(other_J)), other_J] = plan_GS[hot]
        top_J = node_local_gpu_loads(weight_1E.expand(len(other_J), -1), trial_JGS.view(len(other_J), -1), num_gpus,
                                     num_nodes).amax(1)
        j = int(top_J.argmin())
        if top_J[j] >= top * (1 - 1e-9):
            break
        plan_GS = trial_JGS[j]
    return plan_GS.reshape(-1)
