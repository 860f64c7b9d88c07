"""Serving: requests, KV-block bookkeeping, scheduling, the engine, the offline LLM API and the CLI."""

from moe_serve.server.core.sampling_params import SamplingParams


def __getattr__(name):  # import the engine lazily: `import moe_serve.server` stays cheap for the CLI
    if name == "LLM":
        from moe_serve.server.frontend.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
