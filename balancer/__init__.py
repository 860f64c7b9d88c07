"""Expert placement: which logical expert each physical slot holds, and how to re-plan it as load drifts."""

from moe_serve.balancer.eplb import rebalance_experts
from moe_serve.balancer.placement import (ReplicaChooser, balancedness, build_log2phy, gpu_loads, logical_to_physical,
                                          moved_slots, replica_counts, validate_plan)

__all__ = ["rebalance_experts", "ReplicaChooser", "balancedness", "build_log2phy", "gpu_loads", "logical_to_physical", "moved_slots",
           "replica_counts", "validate_plan"]
