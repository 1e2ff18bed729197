"""`tinyvllm eval perplexity`: the windows it scores, and its perplexity against transformers'."""

from __future__ import annotations

import math

import pytest

from tinyvllm.entrypoints.cli import main
from tinyvllm.entrypoints.eval_cli import Window, make_windows

from ..conftest import hf_prompt_logprobs

TEXT = ("Perplexity measures how surprised a language model is by a text. A model that predicts "
        "every next word well has a low perplexity; one that spreads its probability over many "
        "words has a high one. The river carried boats past the old mill, and the miller "
        "counted them twice.\n")


def test_windows_score_each_token_once():
    assert make_windows(10, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]
    # Overlapping: a window scores only what the ones before it did not.
    assert make_windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6),
                                      Window(6, 10, 8)]
    assert make_windows(9, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5)]  # token 8 has no context
    with pytest.raises(ValueError, match="stride"):
        make_windows(10, 4, 5)


@pytest.mark.slow
@pytest.mark.parametrize("window, stride", [(24, 24), (24, 16)])
def test_perplexity_equals_transformers_over_the_same_windows(tmp_path, capsys, smollm2_model,
                                                              smollm2_hf, window, stride):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    # --dequantize: float32 weights as transformers has them (not int8 activations).
    assert main(["eval", "perplexity", "--device", "cpu", "--dtype", "float32", "--dequantize",
                 "--window", str(window), "--stride", str(stride), str(path)]) == 0
    printed = dict(line.split(": ") for line in capsys.readouterr().out.splitlines())

    ids = smollm2_model.tokenizer.encode(TEXT, add_special_tokens=False)
    nll = []
    for w in make_windows(len(ids), window, stride):
        lps = hf_prompt_logprobs(smollm2_hf, ids[w.begin:w.end])  # token k + 1 at index k
        nll += (-lps[w.first_scored - w.begin - 1:]).tolist()
    assert int(printed["tokens scored"]) == len(nll)
    assert float(printed["perplexity"]) == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-3)
