"""Tokenization stage: tokenizer artifacts, Levanter token caches, and training mixtures.

Pure logic (no Dagster). Levanter/JAX are imported only inside the functions that need them.
See docs/tokenization.md for the on-disk layout and the Levanter data config contract.
"""

from marin_assets.tokenization.cache import (
    RoundtripFailure,
    build_levanter_cache,
    build_levanter_cache_from_documents,
    cache_shard_order,
    decode_roundtrip_check,
    is_validation_document,
    iter_parquet_texts,
    read_cache_stats,
)
from marin_assets.tokenization.cache_config import CacheConfig, CacheStats, SplitStats
from marin_assets.tokenization.mixture import (
    MixtureComponent,
    MixtureSpec,
    render_levanter_data_config,
    render_levanter_data_config_yaml,
)
from marin_assets.tokenization.tokenizer import (
    TokenizerArtifact,
    TokenizerConfig,
    adopt_tokenizer,
    tokenizer_json_sha256,
    train_bpe_tokenizer,
)

__all__ = [
    "CacheConfig",
    "CacheStats",
    "MixtureComponent",
    "MixtureSpec",
    "RoundtripFailure",
    "SplitStats",
    "TokenizerArtifact",
    "TokenizerConfig",
    "adopt_tokenizer",
    "build_levanter_cache",
    "build_levanter_cache_from_documents",
    "cache_shard_order",
    "decode_roundtrip_check",
    "is_validation_document",
    "iter_parquet_texts",
    "read_cache_stats",
    "render_levanter_data_config",
    "render_levanter_data_config_yaml",
    "tokenizer_json_sha256",
    "train_bpe_tokenizer",
]
