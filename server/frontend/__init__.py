"""Front ends of the engine core: the text side of every request.

`output_processor` (detokenization, stop strings, logprobs, final outputs) is the one place text is made; the
offline `LLM` (`llm`) runs the engine core in-process through it, and the OpenAI-compatible HTTP server does the
same across processes: `api` (FastAPI app), `serving` (requests -> engine requests -> responses), `protocol`
(request bodies, error body), `metrics` (Prometheus), `engine_link` (the front end's end of the ZMQ
link: which engine is attached, re-attachment), `engine_client` (requests over it) and `engine_loop` (the
engine's side: it runs the engine core and sends its deltas).

May import: server.core (and through it what the core uses), never server.tools.
"""
