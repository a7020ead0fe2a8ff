"""The checkpoint shipped with the package (`dsv4.checkpoint.shipped_checkpoint`): the small
V4.1 trained by ``scripts/train_tiny.py`` on the standard library (`training.data`), in the released
format with its BPE tokenizer.

It must stay small enough for the repository, reload to the same params (saving the loaded params and loading them again gives them back
exactly: every fp8 / FP4 value with its power-of-two scale is representable again),
and `serving.LLM` on it must decode what `dsv4.generate` decodes (greedy)."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import dsv4
from dsv4 import checkpoint as C
from dsv4.config import ModelConfig, tiny_v41_trained
from dsv4.tokenizer import HFTokenizer, load_tokenizer

PATH = C.shipped_checkpoint("tiny_v41_trained")


@pytest.fixture(scope="module")
def loaded():
    return C.load_pretrained(PATH, progress=False)


def test_files_and_size():
    names = sorted(os.listdir(PATH))
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    total = sum(os.path.getsize(os.path.join(PATH, n)) for n in names)
    assert total < 25 * 2**20, f"{total} bytes: the issue allows 25 MB in the repository"


def test_config_and_tokenizer_are_the_trained_ones():
    cfg = ModelConfig.from_json(PATH)
    assert cfg == tiny_v41_trained()
    tok = load_tokenizer(PATH, cfg)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == cfg.vocab_size
    assert (tok.bos_id, tok.eos_id) == (cfg.bos_token_id, cfg.eos_token_id) == (0, 1)
    text = "def main(argv=None):\n    return 0\n"
    assert tok.decode(tok.encode(text)) == text


def test_reloads_to_the_same_params(loaded, tmp_path):
    cfg, params = loaded
    C.save_pretrained(params, cfg, tmp_path)
    _, again = C.load_pretrained(tmp_path, progress=False)
    assert again.keys() == params.keys()
    for name in params:
        np.testing.assert_array_equal(
            np.asarray(again[name]), np.asarray(params[name]), err_msg=name
        )


def test_unknown_shipped_name():
    with pytest.raises(ValueError, match="no shipped checkpoint 'tiny_v41_trainedd'"):
        C.shipped_checkpoint("tiny_v41_trainedd")


def test_llm_generate_equals_dsv4_generate(loaded, shipped_llm):
    from serving import SamplingParams

    cfg, params = loaded
    llm = shipped_llm  # tests/conftest.py: the engine the server's tests serve
    prompts = ["import os\n\n\ndef ", "class Stack:\n    def push(self, item):\n"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    tok = llm.get_tokenizer()
    ids = [tok.encode(p, add_bos=True) for p in prompts]
    width = max(map(len, ids))
    batch = np.zeros((len(ids), width), np.int32)
    for row, seq in zip(batch, ids):
        row[: len(seq)] = seq
    with jax.default_matmul_precision("highest"):  # one batch: one compilation
        ref = np.asarray(
            dsv4.generate(params, cfg, batch, 12, prompt_lengths=[len(i) for i in ids])
        )
    for i, out in enumerate(outs):
        assert out.prompt_token_ids == ids[i]
        assert list(out.outputs[0].token_ids) == ref[i].tolist()
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
