"""Serving benchmark against any OpenAI-compatible endpoint (open-loop Poisson arrivals, streaming).

The same as `moe bench serve`; the code lives in `server/tools/bench.py`. Example:
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model-dir .cache/bench \\
        --request-rates 0.5 1 2 4 inf --num-prompts 64 --result-json out/bench.json
"""

from __future__ import annotations

import sys


from moe_serve.server.tools.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
