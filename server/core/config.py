"""Engine settings: one flat dataclass, validated on construction, built from keyword arguments or
CLI flags by field name."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.balancer.rebalancer import EplbConfig
from moe_serve.kernels.select import CHOICES as KERNEL_BACKENDS
from moe_serve.parallel.config import ParallelConfig
from moe_serve.server.core.scheduler import check_prompt_slowdown, check_prompt_spread_max

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (the checkpoint's torch_dtype)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prompt_spread_ms: float = 0.0  # while decodes run, spread a new prompt over steps for up to this long (scheduler)
    min_prompt_chunk: int = 16  # spread or not, a step with prompts pending gives them at least this many tokens
    prompt_slowdown: float = 0.0  # with a spread: prompt tokens keep a step within this x its decodes' time (scheduler)
    prompt_spread_max_ms: float = 0.0  # with a spread: a bunch of arrivals may stretch to this (scheduler)
    kv_cache_tokens: int = 32768
    block_size: int = 16
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "auto"  # auto = cuda when available, else cpu (under torchrun: cuda:LOCAL_RANK)
    kernel_backend: str = "auto"  # auto | torch | cpu | cuda (kernels/select.py)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    collective_timeout_s: float = 60.0
    ranks_per_node: int | None = None  # None: torchrun's --nproc-per-node (LOCAL_WORLD_SIZE)
    # expert load balancing (see balancer/rebalancer.py)
    enable_eplb: bool = False
    eplb_window: int = 1000
    eplb_interval: int = 3000
    eplb_layers_per_step: int = 1
    eplb_min_gain: float = 0.01  # re-plan only when mean balancedness would rise by at least this much
    eplb_plan_steps: int = 2  # steps a periodic plan is computed in the background before it is taken
    num_redundant_experts: int = 0
    expert_placement: str | None = None  # a placement file or load dump to start from
    step_trace: str | None = None  # append a line per step to this file (server/core/step_trace.py)

    def __post_init__(self) -> None:
        if self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"dtype {self.dtype!r} is not supported; expected one of {[*DTYPES, 'auto']}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {', '.join(KERNEL_BACKENDS)}, got {self.kernel_backend!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "min_prompt_chunk", "kv_cache_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.prompt_spread_ms, (int, float)) or not 0 <= self.prompt_spread_ms <= 60_000:
            raise ValueError(f"prompt_spread_ms must be between 0 (off) and 60000, got {self.prompt_spread_ms!r}")
        check_prompt_slowdown(self.prompt_slowdown)
        check_prompt_spread_max(self.prompt_spread_max_ms, self.prompt_spread_ms, "ms")
        if self.prompt_slowdown and not self.prompt_spread_ms:
            raise ValueError("prompt_slowdown paces prompts beside running decodes and needs prompt_spread_ms > 0 "
                             "(the due time a burst of prompts must still meet)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        self.eplb_config()  # validates the balancer fields
        if (self.enable_eplb or self.num_redundant_experts) and not self.enable_expert_parallel:
            raise ValueError("enable_eplb and num_redundant_experts need enable_expert_parallel")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens {self.kv_cache_tokens} is smaller than one block ({self.block_size})")

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return DTYPES.get(checkpoint_dtype or "float32", torch.float32)

    def eplb_config(self) -> EplbConfig:
        return EplbConfig(self.enable_eplb, self.eplb_window, self.eplb_interval, self.num_redundant_experts,
                          self.eplb_layers_per_step, self.eplb_min_gain, self.eplb_plan_steps)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size,
                              self.enable_expert_parallel, self.collective_timeout_s, self.ranks_per_node)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
