"""Group ``models``: the base policy every training run starts from."""

import hashlib
import time
from typing import Optional

from dagster import AssetExecutionContext, Config, DataVersion, Failure, MaterializeResult, MetadataValue, asset
from pydantic import Field

from resources import ModelStore, Warehouse
from rlvr import policy
from rlvr_assets.metering import metered
from rlvr_assets.partitions import add_policy_version

SAVE_DTYPES = ("float32", "bfloat16", "float16")


class BasePolicyConfig(Config):
    """Which causal LM becomes the base policy."""

    model: str = Field(default=policy.EMBEDDED_MODEL, description="'embedded:smollm2-135m-instruct', a local HF folder, a .gguf file or a hub model id")
    revision: Optional[str] = Field(default=None, description="hub revision (hub ids only)")
    save_dtype: str = Field(default="float32", description="dtype of the stored weights: float32, bfloat16 or float16")


@asset(group_name="models", kinds={"pytorch"}, owners=["team:rlvr-training"], tags={"domain": "math"})
@metered
def base_policy(context: AssetExecutionContext, config: BasePolicyConfig, model_store: ModelStore, duckdb: Warehouse) -> MaterializeResult:
    """The base policy as a standard Hugging Face checkpoint (safetensors, tokenizer, chat template)
    in the model store. GGUF sources are dequantized once; the version is the hash of the source
    and dtype, so re-materializing an unchanged source reuses the stored checkpoint.
    """
    import torch

    if config.save_dtype not in SAVE_DTYPES:
        raise Failure(description=f"base_policy: save_dtype {config.save_dtype!r} is not one of {SAVE_DTYPES}")
    try:
        source = policy.resolve_source(config.model, config.revision)
    except FileNotFoundError as err:
        raise Failure(description=f"base_policy: {err}") from None
    started = time.perf_counter()
    source_hash = policy.source_hash(source)
    version = hashlib.sha256(f"{source_hash}:{config.save_dtype}".encode()).hexdigest()[:16]
    stored = model_store.get("base_policy", version)
    cached = stored is not None
    if stored is None:
        context.log.info(f"converting {source.describe()} to a {config.save_dtype} HF checkpoint")
        model, tokenizer = policy.load_source(source, dtype=getattr(torch, config.save_dtype))
        stored = model_store.put(
            "base_policy",
            lambda folder: policy.export_checkpoint(model, tokenizer, folder),
            version=version,
            metadata={
                "source": source.describe(),
                "source_hash": source_hash,
                "dtype": config.save_dtype,
                "parameters": sum(p.numel() for p in model.parameters()),
            },
        )
    else:
        model_store.set_latest("base_policy", version)
    add_policy_version(context.instance, "base_policy", version)
    manifest = stored.manifest
    return MaterializeResult(
        metadata={
            "path": MetadataValue.path(str(stored.path)),
            "version": version,
            "source": manifest["source"],
            "source_hash": manifest["source_hash"],
            "parameters": manifest["parameters"],
            "dtype": manifest["dtype"],
            "size_mb": round(stored.size_bytes / 2**20, 1),
            "reused_stored_checkpoint": cached,
            "seconds": round(time.perf_counter() - started, 2),
        },
        data_version=DataVersion(version),
    )
