"""benchmarks/engine_phases.py: py-spy stacks into the share of each engine phase.

    pytest -q tests/test_engine_phases.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_script

phases = load_script("engine_phases")

ENGINE = "thread (7): gptopt-engine;Thread.run (threading.py:982);Engine._loop (gptopt/serve/engine.py:268)"
STACKS = [
    f"{ENGINE};Engine._iterate (e.py:1);Condition.wait (threading.py:327) 50",
    f"{ENGINE};Engine._decode (e.py:2);Generator.decode_next (g.py:3);Generator.decode (g.py:4);"
    "Linear.forward (linear.py:134) 30",
    f"{ENGINE};Engine._decode (e.py:2);Generator.sample_next (g.py:5);Generator.sample (g.py:6) 5",
    # the prefill's forward runs through the same Generator._forward as the eager decode's
    f"{ENGINE};Engine._prefill (e.py:12);Generator.prefill_step (g.py:13);Generator.extend (g.py:14);"
    "Generator._forward (g.py:15);Linear.forward (linear.py:134) 20",
    f"{ENGINE};Engine._decode (e.py:2);Generator.decode_next (g.py:3);Generator.decode (g.py:4);"
    "Generator._forward (g.py:15);Linear.forward (linear.py:134) 10",
    f"{ENGINE};Engine._decode (e.py:2);Engine._accept (e.py:7);StopChecker.add (g.py:8);"
    "StopChecker._advance (g.py:9) 10",
    f"{ENGINE};Engine._iterate (e.py:1);Engine._deliver (e.py:10);deliver (e.py:11) 5",
    "thread (1): MainThread;run (u.py:1);sse (gptopt/serve/sse.py:60) 4",
    "thread (1): MainThread;run (u.py:1);Routes.completions (gptopt/serve/routes.py:330);"
    "Routes.encode (gptopt/serve/routes.py:190) 2",
    "thread (1): MainThread;run (u.py:1);RequestResponseCycle.send (uvicorn/protocols/http/h11_impl.py:498) 3",
    "thread (1): MainThread;Runner.run (asyncio/runners.py:118) 1",
    # blocked in C, though sampled as running: a pool worker waiting for work, the events pipe's read
    "thread (9): asyncio_0;Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:81) 40",
    "thread (8): gptopt-engine-events;EngineProcess._read (gptopt/serve/engine_process.py:470);"
    "_ConnectionBase.recv (multiprocessing/connection.py:250);Connection._recv (multiprocessing/connection.py:395) 7",
    "not a stack line",
]


def test_each_sample_goes_to_its_innermost_phase_and_idle_is_left_out_of_busy_time() -> None:
    counts = phases.shares(STACKS)
    assert counts["gptopt-engine"] == {"idle": 50, "decode forward": 40, "prefill forward": 20, "sampling": 5,
                                       "detokenize and stop strings": 10, "event delivery": 5}
    assert counts["MainThread"] == {"SSE frames": 4, "tokenize": 2, "HTTP stack": 3, "event loop": 1}
    assert counts["asyncio_0"] == {"idle": 40}
    assert counts["gptopt-engine-events"] == {"idle": 7}
    text = phases.table(counts)
    assert "gptopt-engine: 130 samples, busy 61.5%" in text
    assert "decode forward                50.0% of its busy time" in text
    assert "prefill forward               25.0% of its busy time" in text


def test_with_the_tokens_received_each_phase_is_given_in_cpu_time_a_token(capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    stacks = tmp_path / "stacks.txt"
    stacks.write_text("\n".join(STACKS))
    # 200 samples a second over 1,000 tokens: a sample is 5 us of CPU a token
    assert phases.main([str(stacks), "--tokens", "1000", "--rate", "200"]) == 0
    out = capsys.readouterr().out
    assert "decode forward                50.0% of its busy time     200.0 us a token" in out
    assert "SSE frames                    40.0% of its busy time      20.0 us a token" in out
    assert "all threads: 450.0 us of CPU a token" in out  # 80 busy samples of the engine, 10 of the main thread


def test_a_missing_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert phases.main([str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt: no such file" in capsys.readouterr().err
