"""Dagster run config built from the core's dataclass configs (resources.run_config.config_from)."""

import dataclasses
import hashlib
import json

import pytest
from dagster import DagsterInvalidConfigError, asset, materialize

from resources import EvalProtocol, config_from
from resources.evaluations import eval_id
from rlvr.evaluation.runner import EvalConfig
from rlvr.generation import SamplingConfig
from rlvr.grpo import GRPOConfig
from rlvr.grpo.profiles import build_config
from rlvr.monitoring.drift import DriftThresholds
from rlvr_assets.monitoring import DriftConfig
from rlvr_assets.training import GRPORunConfig


def test_fields_defaults_and_descriptions_come_from_the_dataclass():
    fields = config_from(EvalConfig).model_fields
    assert list(fields) == [f for f in EvalConfig.__dataclass_fields__]
    assert fields["max_new_tokens"].default == 256 and fields["max_new_tokens"].description == "token budget per completion"
    assert config_from(EvalConfig)().to_core() == EvalConfig()
    assert config_from(EvalConfig)(ks=[1, 4], num_samples=4).to_core() == EvalConfig(ks=[1, 4], num_samples=4)
    assert config_from(EvalConfig) is config_from(EvalConfig)  # one class per dataclass: Dagster sees one config type


def test_nested_dataclasses_tuples_and_callbacks():
    config = config_from(GRPOConfig)
    assert config().to_core() == GRPOConfig()
    built = config(betas=[0.8, 0.9], sampling={"max_new_tokens": 5}).to_core()
    assert built.betas == (0.8, 0.9) and built.sampling == SamplingConfig(max_new_tokens=5)
    sampling = config_from(SamplingConfig).model_fields
    assert "should_stop" not in sampling  # a callback is not run config: the core default stays
    assert sampling["max_batch_rows"].description.startswith("most rows running at once")


@dataclasses.dataclass(frozen=True)
class Inner:
    a: int = 1  # an inner knob


@dataclasses.dataclass
class Outer:
    inner: Inner = Inner(a=3)  # an immutable instance as the default
    pair: tuple[int, int] = (1, 2)
    names: list[str] = dataclasses.field(default_factory=lambda: ["x"], metadata={"description": "names, from metadata"})


def test_instance_defaults_and_metadata_descriptions():
    config = config_from(Outer)
    assert config().to_core() == Outer()
    assert config(inner={"a": 5}).to_core().inner == Inner(a=5)
    assert config.model_fields["names"].description == "names, from metadata"
    overrides = config_from(Outer, overrides=True)
    assert overrides().set_fields() == {} and overrides(inner={"a": 5}).set_fields() == {"inner": {"a": 5}}


def test_drift_thresholds_are_the_drift_config():
    assert DriftConfig().to_core() == DriftThresholds()
    assert DriftConfig(psi=0.5, window=10).to_core() == DriftThresholds(psi=0.5)
    assert DriftConfig.model_fields["psi"].description.startswith("major shift")


def test_the_protocol_keeps_the_identity_of_stored_evaluations():
    protocol = EvalProtocol()
    assert protocol.to_core() == EvalConfig()
    before = {
        "split": "test",
        "limit": 50,
        "max_new_tokens": 256,
        "num_samples": 0,
        "ks": [1],
        "sample_temperature": 0.7,
        "batch_rows": 32,
        "reward_weights": {"math_answer": 1.0, "format": 0.2},
        "seed": 0,
    }
    key = json.dumps({"policy": "v1", "protocol": before, "problems": ["h1", "h2"]}, sort_keys=True)
    problems = [{"content_hash": "h1"}, {"content_hash": "h2"}]
    assert eval_id("v1", protocol, problems) == hashlib.sha256(key.encode()).hexdigest()[:16]


def grpo_config_of(run_config: dict) -> GRPOConfig:
    seen = []

    @asset
    def training(config: GRPORunConfig) -> None:
        seen.append(config.grpo_config())

    materialize([training], run_config={"ops": {"training": {"config": run_config}}})
    return seen[0]


def test_grpo_run_config_written_as_the_readme_shows_merges_into_the_profile():
    assert grpo_config_of({}) == build_config("default")
    config = grpo_config_of(
        {"profile": "default", "overrides": {"total_steps": 20, "lr": 1e-6, "loss_type": "gspo", "sampling": {"max_new_tokens": 256}, "lora": {"rank": 4}}}
    )
    assert config.total_steps == 20 and config.lr == 1e-6 and config.loss_type == "gspo"
    assert config.sampling.max_new_tokens == 256
    assert config.sampling.temperatures == build_config("default").sampling.temperatures  # merged, not replaced
    assert config.lora.rank == 4 and config.lora.alpha == 32
    assert config.prompts_per_step == build_config("default").prompts_per_step  # unset: the profile's
    assert grpo_config_of({"profile": "full"}) == build_config("full")


def test_grpo_run_config_rejects_unknown_and_mistyped_fields():
    with pytest.raises(DagsterInvalidConfigError, match="total_stepz"):
        grpo_config_of({"overrides": {"total_stepz": 3}})
    with pytest.raises(DagsterInvalidConfigError):
        grpo_config_of({"overrides": {"total_steps": "many"}})
