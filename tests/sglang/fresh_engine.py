"""What stock SGLang engines started fresh from HF directories generate (the tier's references).

``python fresh_engine.py OUT.json MODEL...`` starts one ``sglang.Engine`` per model, one after
another (never two at once on a small machine), and writes their
:func:`sglang_helpers.greedy` outputs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: str, *models: str) -> None:
    from sglang_helpers import greedy, sglang_engine

    results = {}
    for model in models:
        with sglang_engine(model) as engine:
            results[model] = greedy(engine)
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
