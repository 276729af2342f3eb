"""`gptopt bench`: the training ladder (ladder.py) or, with --mode infer, the inference ladder (infer.py).

    gptopt bench --rungs list
    gptopt bench --mode infer
"""

from __future__ import annotations

from gptopt.config import BenchConfig


def main(cfg: BenchConfig) -> int:
    # imported by mode: one ladder's dependencies (the inference ladder's ONNX, quantisation) stay unloaded for the other
    if cfg.mode == "infer":
        from gptopt.bench.infer import main as infer_main

        return infer_main(cfg)
    from gptopt.bench.ladder import main as ladder_main

    return ladder_main(cfg)
