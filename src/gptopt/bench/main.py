"""`gptopt bench`: the training ladder (ladder.py); with --mode infer the inference ladder (infer_ladder.py);
with --mode quality the recipe ladder, minutes to a target val loss (quality.py).

    gptopt bench --rungs list
    gptopt bench --mode infer
    gptopt bench --mode quality --seeds 3
    gptopt bench --overwrite       # again into bench_out: the old report stays until the new one is written
"""

from __future__ import annotations

from pathlib import Path

from gptopt.bench.report import check_output_dir
from gptopt.config import BenchConfig
from gptopt.outputs import lock_output
from gptopt.runtime import signals


def main(cfg: BenchConfig) -> int:
    if cfg.rungs.strip() == "list":  # the list is printed, nothing written
        return _ladder(cfg)
    out = Path(cfg.output_dir).expanduser()
    with lock_output(out):  # one bench at a time in a folder, whichever its mode
        # Before anything is built or measured: `gptopt bench` run twice must say so at once, not after minutes.
        check_output_dir(out, cfg.mode, cfg.overwrite)
        return _ladder(cfg)


def _ladder(cfg: BenchConfig) -> int:
    # the process's switches, set here where the command starts (runtime/process.py), not by the ladders' classes,
    # which tune builds too
    from gptopt.runtime import process
    from gptopt.runtime.device import resolve

    process.set_matmul_precision(resolve(cfg.device, quiet=True))
    # SIGTERM (a scheduler's time limit, kill) stops a ladder as Ctrl-C does: it reports what it measured, then
    # exits 128 + the signal
    stop = signals.Interrupt()
    with signals.handling(stop):
        code = _run_ladder(cfg)
    return stop.exit_code() if code == signals.CTRL_C_EXIT else code


def _run_ladder(cfg: BenchConfig) -> int:
    # imported by mode: one ladder's dependencies (the inference ladder's ONNX, quantisation) stay unloaded for the
    # other
    if cfg.mode == "infer":
        from gptopt.bench.infer_ladder import main as infer_main

        return infer_main(cfg)
    if cfg.mode == "quality":
        from gptopt.bench.quality import main as quality_main

        return quality_main(cfg)
    from gptopt.bench.ladder import main as ladder_main

    return ladder_main(cfg)
