"""Group ``serving``: the champion policy packed into a Bento."""

from pathlib import Path

from dagster import AssetExecutionContext, AssetKey, Failure, MaterializeResult, MetadataValue, asset

from bentos.build import bentoml_home, build_bento, store_policy
from resources import MLflowResource, ModelStore
from resources.tracking import CHAMPION, POLICY_VERSION_TAG
from rlvr_assets.freshness import WEEKLY
from rlvr_assets.registry import download_checkpoint


@asset(group_name="serving", kinds={"bentoml"}, owners=["team:rlvr-serving"], deps=["champion_policy"],
       output_required=False, freshness_policy=WEEKLY)
def bento(context: AssetExecutionContext, model_store: ModelStore, mlflow: MLflowResource):
    """The champion policy in the BentoML model store (its MLflow lineage as labels) and a Bento
    built around it, offline. Not rebuilt while the champion is unchanged, so a retraining whose
    policy failed the promotion gate ends without a new Bento."""
    champion = mlflow.registry().version_for(CHAMPION)
    if champion is None:
        raise Failure(description="bento: the registry has no champion yet: materialize champion_policy first")
    version = champion.tags[POLICY_VERSION_TAG]
    previous = context.instance.get_latest_materialization_event(AssetKey("bento"))
    if previous is not None and previous.asset_materialization is not None:
        meta = previous.asset_materialization.metadata
        built_path = meta.get("path")
        if meta.get("model_version") and meta["model_version"].value == version and built_path and Path(built_path.value).is_dir():
            context.log.info(f"bento: champion {version} unchanged since {meta['bento_tag'].value}; nothing to build")
            return
    stored = model_store.get("grpo_checkpoint", version)
    path = stored.path if stored is not None else download_checkpoint(mlflow, champion.source)
    labels = {
        "model_version": version,
        "registered_model": mlflow.registered_model,
        "registry_version": str(champion.version),
        "mlflow_run_id": champion.run_id or "",
        "data_hash": champion.tags.get("data_hash", ""),
        "base_policy_version": champion.tags.get("base_policy_version", ""),
    }
    model_tag = store_policy(path, labels, metadata={"source": champion.source})
    built = build_bento(model_tag, labels={"model_version": version, "registry_version": str(champion.version)})
    context.log.info(f"built {built.tag}; serve it with: {built.serve_command}")
    yield MaterializeResult(metadata={
        "bento_tag": built.tag,
        "model_tag": model_tag,
        "model_version": version,
        "size_mb": round(built.size_bytes / 2**20, 1),
        "serve_command": MetadataValue.md(f"```\n{built.serve_command}\n```"),
        "containerize_command": MetadataValue.md(f"```\nBENTOML_HOME={bentoml_home()} bentoml containerize {built.tag}\n```"),
        "path": MetadataValue.path(str(built.path)),
    })
