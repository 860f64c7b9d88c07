"""The engine core: requests, scheduling, KV blocks, the model runner, the sampler and the engine step.

Token ids in, token ids out: `EngineCore.add_request(prompt_token_ids, params)` and `EngineCore.step()`, which
returns per request only what is new (`EngineOutput`). No text, no tokenizer, no HTTP. The engine knows the
scheduler and the runner; the runner owns the model, and the engine reaches its MoE layers only through
`ModelRunner.moe_layers()` (expert-load recording, rebalancing).

May import: moe_serve.moe, experts, balancer, parallel, kernels, and within server only server.core.
"""
