"""Group ``serving``: the champion policy packed into a Bento."""

from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, asset

from resources import CHAMPION, BentoBuilder, MLflowResource, ModelStore, Warehouse
from resources.tracking import POLICY_VERSION_TAG
from rlvr.policy import stored_environment
from rlvr_assets.freshness import WEEKLY
from rlvr_assets.metering import metered


@asset(group_name="serving", kinds={"bentoml"}, owners=["team:rlvr-serving"], deps=["champion_policy"], output_required=False, freshness_policy=WEEKLY)
@metered
def bento(context: AssetExecutionContext, model_store: ModelStore, mlflow: MLflowResource, bento_builder: BentoBuilder, duckdb: Warehouse):
    """The champion policy in the BentoML model store (its MLflow lineage as labels) and a Bento
    built around it, offline; the service rolls out in the environment the checkpoint records. Not
    rebuilt while the BentoML store holds a Bento of the champion, so a retraining whose policy
    failed the promotion gate ends without a new Bento."""
    champion = mlflow.registry().version_for(CHAMPION)
    if champion is None:
        raise Failure(description="bento: the registry has no champion yet: materialize champion_policy first")
    version = champion.tags[POLICY_VERSION_TAG]
    existing = bento_builder.built_for(version)
    if existing is not None:
        context.log.info(f"bento: champion {version} unchanged since {existing}; nothing to build")
        return
    stored = model_store.get("grpo_checkpoint", version)
    path = stored.path if stored is not None else mlflow.download_checkpoint(champion.source)
    environment = stored_environment(path)  # travels inside the checkpoint; shown here as lineage
    model_tag = bento_builder.store_model(
        path,
        {
            "model_version": version,
            "registered_model": mlflow.registered_model,
            "registry_version": str(champion.version),
            "mlflow_run_id": champion.run_id or "",
            "data_hash": champion.tags.get("data_hash", ""),
            "base_policy_version": champion.tags.get("base_policy_version", ""),
            "environment": environment["name"],
        },
        metadata={"source": champion.source, "environment": environment},
    )
    labels = {"model_version": version, "registry_version": str(champion.version), "environment": environment["name"]}
    built = bento_builder.build(model_tag, labels=labels)
    context.log.info(f"built {built.tag}; serve it with: {built.serve_command}")
    yield MaterializeResult(
        metadata={
            "bento_tag": built.tag,
            "model_tag": model_tag,
            "model_version": version,
            "environment": MetadataValue.json(environment),
            "champion in MLflow": MetadataValue.url(mlflow.links().model_version(champion.version)),
            "size_mb": round(built.size_bytes / 2**20, 1),
            "serve_command": MetadataValue.md(f"```\n{built.serve_command}\n```"),
            "containerize_command": MetadataValue.md(f"```\n{bento_builder.containerize_command(built.tag)}\n```"),
            "path": MetadataValue.path(str(built.path)),
        }
    )
