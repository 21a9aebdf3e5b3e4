"""Tokenizer artifact, split rule and mixture rendering: no Levanter import in this module."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import yaml

from marin_assets.tokenization.cache_config import CacheConfig
from marin_assets.tokenization.mixture import (
    MixtureComponent,
    MixtureSpec,
    render_levanter_data_config,
    render_levanter_data_config_yaml,
)
from marin_assets.tokenization.tokenizer import (
    TokenizerConfig,
    adopt_tokenizer,
    tokenizer_json_sha256,
    train_bpe_tokenizer,
)
from marin_resources.splits import is_validation_document

TRICKY = [
    "Windows line endings\r\nsecond line\r\n\r\n",
    "\tleading tab and  double  spaces   \n   indented trailing spaces   ",
    " starts with a space",
    "Unicode: naïve café, 日本語, emoji 🦙, combining e\u0301",
    "Text that spells special tokens: <|bos|> <|eos|> <|pad|>",
]


def test_tokenizer_directory_loads_offline_with_autotokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    assert sorted(os.listdir(tokenizer_dir)) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    enc = tok("hi there")
    # BOS is prepended by default; no token_type_ids (Levanter would expect that field in the cache).
    assert set(enc) == {"input_ids", "attention_mask"}
    assert enc["input_ids"][0] == tok.bos_token_id and enc["input_ids"][-1] != tok.eos_token_id
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert config["clean_up_tokenization_spaces"] is False


@pytest.mark.parametrize("text", TRICKY)
def test_byte_level_decode_is_exact(tokenizer_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    if "<|" not in text:  # HF parses special-token text as special tokens; skipping drops them
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_training_is_deterministic_within_and_across_processes(corpus, tokenizer_dir, tmp_path):
    cfg = TokenizerConfig(vocab_size=512)
    again = train_bpe_tokenizer(corpus, cfg, str(tmp_path / "again"))
    assert again.tokenizer_json_sha256 == tokenizer_json_sha256(tokenizer_dir)
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), "rb") as a, \
            open(tmp_path / "again" / "tokenizer.json", "rb") as b:
        assert a.read() == b.read()

    # A fresh interpreter with a different hash seed (Rust/Python hash maps reseeded) gives the same bytes.
    corpus_file = tmp_path / "corpus.json"
    corpus_file.write_text(json.dumps(corpus))
    script = (
        "import json,sys\n"
        "from marin_assets.tokenization.tokenizer import TokenizerConfig, train_bpe_tokenizer\n"
        "texts = json.load(open(sys.argv[1]))\n"
        "print(train_bpe_tokenizer(texts, TokenizerConfig(vocab_size=512), sys.argv[2]).tokenizer_json_sha256)\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", script, str(corpus_file), str(tmp_path / "subproc")],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip().splitlines()[-1] == again.tokenizer_json_sha256


def test_different_corpus_or_config_gives_a_different_tokenizer(corpus, tokenizer_dir, tmp_path):
    base = tokenizer_json_sha256(tokenizer_dir)
    other_texts = train_bpe_tokenizer(corpus[::2], TokenizerConfig(vocab_size=512), str(tmp_path / "a"))
    other_vocab = train_bpe_tokenizer(corpus, TokenizerConfig(vocab_size=600), str(tmp_path / "b"))
    assert len({base, other_texts.tokenizer_json_sha256, other_vocab.tokenizer_json_sha256}) == 3
    assert other_vocab.vocab_size == 600


def test_custom_special_tokens_and_byte_cap(corpus, tmp_path):
    cfg = TokenizerConfig(
        vocab_size=400, bos_token="<s>", eos_token="</s>", pad_token="<pad>", extra_special_tokens=("<sep>",),
        max_train_bytes=20_000, add_bos_on_encode=False,
    )
    art = train_bpe_tokenizer(iter(corpus), cfg, str(tmp_path / "tok"))
    assert (art.bos_token_id, art.eos_token_id, art.pad_token_id) == (0, 1, 2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert tok.convert_tokens_to_ids("<sep>") == 3
    assert tok("hi")["input_ids"][0] != tok.bos_token_id  # no BOS when add_bos_on_encode=False
    # The byte cap means a prefix of the corpus is used: same result as passing that prefix.
    prefix, seen = [], 0
    for t in corpus:
        if seen >= 20_000:
            break
        prefix.append(t)
        seen += len(t.encode())
    capped = train_bpe_tokenizer(prefix, cfg, str(tmp_path / "prefix"))
    assert capped.tokenizer_json_sha256 == art.tokenizer_json_sha256


@pytest.mark.parametrize(
    "kwargs",
    [dict(vocab_size=100), dict(bos_token="<x>", eos_token="<x>"), dict(min_frequency=0), dict(eos_token="")],
)
def test_bad_tokenizer_config_is_rejected(kwargs):
    with pytest.raises(ValueError):
        TokenizerConfig(**kwargs)


def test_training_rejects_non_string_texts(tmp_path):
    with pytest.raises(TypeError):
        train_bpe_tokenizer(["ok", b"bytes"], TokenizerConfig(vocab_size=300), str(tmp_path / "t"))


def test_adopt_tokenizer_from_local_directory(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    art = adopt_tokenizer(tokenizer_dir, str(tmp_path / "adopted"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "adopted"), local_files_only=True)
    orig = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    assert art.vocab_size == len(orig) == len(tok)
    assert (art.bos_token_id, art.eos_token_id) == (orig.bos_token_id, orig.eos_token_id)
    for text in TRICKY:
        assert tok(text)["input_ids"] == orig(text)["input_ids"]


def test_adopt_tokenizer_missing_source_fails(tmp_path):
    with pytest.raises(FileNotFoundError):
        adopt_tokenizer(str(tmp_path / "does-not-exist"), str(tmp_path / "out"))


def test_validation_membership_is_a_deterministic_function_of_the_id():
    ids = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(20_000)]
    picked = [is_validation_document(i, 0.1) for i in ids]
    assert picked == [is_validation_document(i, 0.1) for i in ids]
    assert 0.09 < sum(picked) / len(ids) < 0.11
    # Monotone in the fraction: a larger held-out set contains the smaller one.
    assert all(is_validation_document(i, 0.2) for i, p in zip(ids, picked) if p)
    assert not any(is_validation_document(i, 0.0) for i in ids)


@pytest.mark.parametrize("kwargs", [dict(validation_fraction=1.0), dict(validation_fraction=-0.1), dict(batch_rows=0)])
def test_bad_cache_config_is_rejected(kwargs):
    with pytest.raises(ValueError):
        CacheConfig(**kwargs)


def _spec(order: list[str]) -> MixtureSpec:
    comps = {
        "web": MixtureComponent("gs://bucket/tok/web/v3/", 0.7, tags=("en", "web")),
        "code": MixtureComponent("gs://bucket/tok/code/v1", 0.3),
        "heldout": MixtureComponent("gs://bucket/tok/heldout/v2", 0.0, tags=("eval",)),
    }
    return MixtureSpec(name="mix", components={k: comps[k] for k in order}, tokenizer_dir="gs://bucket/tokenizer/v1")


def test_mixture_renders_deterministically_with_sorted_keys():
    a = render_levanter_data_config(_spec(["web", "code", "heldout"]))
    b = render_levanter_data_config(_spec(["heldout", "code", "web"]))
    assert a == b
    assert json.dumps(a) == json.dumps(b)  # same key order too
    assert render_levanter_data_config_yaml(_spec(["web", "code", "heldout"])) == render_levanter_data_config_yaml(
        _spec(["code", "heldout", "web"])
    )
    assert list(a) == sorted(a) and list(a["configs"]) == sorted(a["configs"])
    assert a["train_weights"] == {"code": 0.3, "heldout": 0.0, "web": 0.7}
    assert a["configs"]["web"] == {"cache_dir": "gs://bucket/tok/web/v3", "tags": ["en", "web"], "train_urls": [],
                                   "validation_urls": []}
    assert a["tokenizer"] == "gs://bucket/tokenizer/v1" and a["cache_dir"] is None
    assert yaml.safe_load(render_levanter_data_config_yaml(_spec(["web", "code", "heldout"]))) == a
    assert _spec(["web", "code", "heldout"]).validation_only_components == ["heldout"]


def test_mixture_from_dict_matches_dataclass_form():
    spec = MixtureSpec.from_dict(
        {
            "name": "mix",
            "tokenizer_dir": "gs://bucket/tokenizer/v1",
            "components": {
                "web": {"cache_root": "gs://bucket/tok/web/v3/", "weight": 0.7, "tags": ["en", "web"]},
                "code": {"cache_root": "gs://bucket/tok/code/v1", "weight": 0.3},
                "heldout": {"cache_root": "gs://bucket/tok/heldout/v2", "weight": 0, "tags": ["eval"]},
            },
        }
    )
    assert render_levanter_data_config(spec) == render_levanter_data_config(_spec(["web", "code", "heldout"]))


@pytest.mark.parametrize(
    "components",
    [
        {},
        {"a": MixtureComponent("/x", 0.0)},
        {"a/b": MixtureComponent("/x", 1.0)},
    ],
)
def test_bad_mixture_is_rejected(components):
    with pytest.raises(ValueError):
        MixtureSpec(name="m", components=components, tokenizer_dir="/tok")


def test_negative_or_nan_weight_is_rejected():
    for w in (-1.0, float("nan")):
        with pytest.raises(ValueError):
            MixtureComponent("/x", w)


def test_package_import_does_not_pull_in_levanter_jax_or_dagster():
    code = (
        "import sys, marin_assets.tokenization\n"
        "print(sorted(m for m in ('levanter', 'jax', 'ray', 'haliax', 'dagster') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
