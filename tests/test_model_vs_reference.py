"""benchmarks/model_vs_reference.py: gptopt's model timed against a plain GPT-2 module on equal terms.

    pytest -q tests/test_model_vs_reference.py
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_script

from gptopt.config import preset

ref = load_script("model_vs_reference")


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_reference_computes_gptopts_loss_and_gradients_from_the_same_weights(attention: str) -> None:
    """The comparison times two computations of one function: same loss, same gradients."""
    config = preset("debug", vocab_size=1000, vocab_pad_multiple=64, attention=attention)  # 24 padded rows
    ours, reference = ref.pair(config)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, config.vocab_size, (3, config.block_size), generator=g) for _ in range(2))
    losses = [m(x, y) for m in (ours, reference)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    grads = [dict((n, p.grad) for n, p in m.named_parameters()) for m in (ours, reference)]
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_round_count_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ref.main(["--preset", "debug", "--rounds", "0"])
    assert e.value.code == 2 and "--rounds must be at least 1" in capsys.readouterr().err
