"""benchmarks/tenant_model.py: the harvest benchmark's tenant of a named shape — its parameter count known beforehand
(checked against Qwen2-7B's published count), and the arguments it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmarks import their siblings by name

import tenant_model  # noqa: E402


@pytest.mark.parametrize("shape, vocab, params", [
    ("qwen2-7b", 152064, 7_615_616_512),  # Qwen2-7B as published
    ("qwen2-7b", 32000, 6_754_997_760),  # the tenant with the recipe's tokenizer
    ("qwen2.5-14b", 152064, 14_770_033_664),  # Qwen2.5-14B as published
    ("qwen2-1.5b", 151936, 1_543_714_304 + 151936 * 1536),  # Qwen2-1.5B ties its embeddings; untied here
])
def test_the_parameter_count_is_known_beforehand(shape, vocab, params):
    assert tenant_model.parameters(tenant_model.SHAPES[shape], vocab) == params


def test_a_tokenizer_folder_without_a_tokenizer_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tenant_model.main([str(tmp_path / "out"), "--tokenizer", str(tmp_path)])
    assert "no tokenizer_config.json there" in capsys.readouterr().err


def test_a_folder_that_holds_files_is_not_written_over(tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("kept")
    with pytest.raises(SystemExit):
        tenant_model.main([str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok")])
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "out" / "mine.txt").read_text() == "kept"


def test_a_tiny_tenant_builds_on_the_cpu(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed here (the [gpu] extra): the tiny build needs it")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed here: the build needs it")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), eos_token="<|endoftext|>")
    tok.save_pretrained(tmp_path / "tok")
    got = tenant_model.build(tmp_path / "out", "tiny", tmp_path / "tok", "cpu")
    assert got["params"] == got["expected_params"] == tenant_model.parameters(tenant_model.SHAPES["tiny"], len(tok))


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok
