"""Unit tests for tether.config (loading, validation, overrides, dumping) and the tether CLI (dry run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import tether.config as config_mod
from tether.cli import main
from tether.config.raw import apply_overrides
from tether.config import (
    ConfigError,
    Section,
    TetherConfig,
    config_from_dict,
    dump_config,
    load_config,
)

MINIMAL = {"model": {"path": "some/model"}}


def _raw(**sections) -> dict:
    raw = {"model": {"path": "some/model"}}
    raw.update(sections)
    return raw


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return str(info.value)


def _write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- #
# defaults and validation
# --------------------------------------------------------------------------- #


def test_minimal_config_loads_with_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, "model:\n  path: some/model\n"))
    assert isinstance(cfg, TetherConfig)
    assert cfg.model.path == "some/model"
    assert cfg.model.dtype == "float32"
    assert cfg.seed == 0
    assert cfg.output_dir == "outputs/run"
    assert cfg.cluster.num_train_actors == 1 and cfg.cluster.colocate is True and cfg.cluster.offload is False
    assert cfg.rollout.temperature == 1.0 and cfg.rollout.top_p == 1.0 and cfg.rollout.top_k == -1
    assert cfg.rollout.stop_token_ids == []
    assert cfg.train.global_batch_size is None
    assert cfg.eval.interval is None and cfg.eval.datasets == []
    assert cfg.checkpoint.load is None
    # Resolved properties.
    assert cfg.global_batch_size == cfg.rollout.prompts_per_rollout * cfg.rollout.n_samples_per_prompt
    assert cfg.checkpoint_dir == Path("outputs/run") / "checkpoints"
    assert cfg.algorithm.needs_ref_model is False


def test_model_path_is_required():
    msg = _error({})
    assert "model" in msg
    assert "Field required" in msg


@pytest.mark.parametrize(
    "raw, field",
    [
        (_raw(rollout={"temprature": 0.7}), "rollout.temprature"),
        (_raw(temprature=0.7), "temprature"),
        (_raw(cluster={"num_trainers": 2}), "cluster.num_trainers"),
        (_raw(eval={"datasets": [{"name": "a", "path": "a.jsonl", "temprature": 0}]}), "eval.datasets.0.temprature"),
    ],
)
def test_unknown_field_is_rejected_with_dotted_path(raw, field):
    msg = _error(raw)
    assert f"{field}: unknown field" in msg


@pytest.mark.parametrize(
    "raw, field, value",
    [
        (_raw(rollout={"temperature": "hot"}), "rollout.temperature", "'hot'"),
        (_raw(cluster={"colocate": "maybe"}), "cluster.colocate", "'maybe'"),
        (_raw(train={"micro_batch_size": 2.5}), "train.micro_batch_size", "2.5"),
        (_raw(rollout={"stop_token_ids": 3}), "rollout.stop_token_ids", "3"),
        (_raw(model={"path": "m", "dtype": "float16"}), "model.dtype", "'float16'"),
    ],
)
def test_wrong_type_names_field_and_value(raw, field, value):
    msg = _error(raw)
    line = next(ln for ln in msg.splitlines() if ln.strip().startswith(field + ":"))
    assert f"(got {value})" in line


@pytest.mark.parametrize(
    "raw, field",
    [
        (_raw(rollout={"temperature": 0}), "rollout.temperature"),
        (_raw(rollout={"top_p": 1.5}), "rollout.top_p"),
        (_raw(rollout={"top_p": 0}), "rollout.top_p"),
        (_raw(rollout={"top_k": -2}), "rollout.top_k"),
        (_raw(train={"lr": 0}), "train.lr"),
        (_raw(train={"adam_beta2": 1.0}), "train.adam_beta2"),
        (_raw(cluster={"num_train_actors": 0}), "cluster.num_train_actors"),
        (_raw(eval={"datasets": [{"name": "a", "path": "a.jsonl", "top_p": 1.5}]}), "eval.datasets.0.top_p"),
    ],
)
def test_range_violation_names_field(raw, field):
    msg = _error(raw)
    assert f"  {field}: " in msg


def test_eval_temperature_zero_is_greedy_and_allowed():
    # Unlike rollout.temperature (> 0: the trainer divides by it), eval may decode greedily.
    cfg = config_from_dict(_raw(eval={"interval": 1, "datasets": [{"name": "a", "path": "a.jsonl", "temperature": 0}]}))
    assert cfg.eval.datasets[0].temperature == 0


def test_global_batch_size_must_divide_rollout_batch():
    msg = _error(_raw(rollout={"prompts_per_rollout": 4, "n_samples_per_prompt": 3}, train={"global_batch_size": 8}))
    assert "train.global_batch_size=8" in msg
    assert "= 12" in msg
    # Divisors are fine.
    cfg = config_from_dict(_raw(rollout={"prompts_per_rollout": 4, "n_samples_per_prompt": 3}, train={"global_batch_size": 6}))
    assert cfg.global_batch_size == 6


def test_global_batch_size_must_be_divisible_by_train_actors():
    msg = _error(_raw(rollout={"prompts_per_rollout": 4, "n_samples_per_prompt": 2}, train={"global_batch_size": 8},
                      cluster={"num_train_actors": 3}))
    assert "train.global_batch_size=8" in msg
    assert "cluster.num_train_actors=3" in msg


def test_offload_needs_colocate():
    msg = _error(_raw(cluster={"offload": True, "colocate": False}))
    assert "cluster.offload" in msg and "cluster.colocate" in msg
    assert config_from_dict(_raw(cluster={"offload": True, "colocate": True})).cluster.offload is True


def test_keep_order_finish_needs_partial_rollout_and_streaming():
    msg = _error(_raw(rollout={"keep_order": "finish"}))
    assert "rollout.keep_order: finish" in msg and "rollout.partial_rollout" in msg
    msg = _error({**_raw(rollout={"keep_order": "finish", "partial_rollout": True}), "deterministic": True})
    assert "rollout.keep_order: finish" in msg and "deterministic: true" in msg
    cfg = config_from_dict(_raw(rollout={"keep_order": "finish", "partial_rollout": True}))
    assert cfg.rollout.keep_order == "finish"


def test_duplicate_eval_dataset_names():
    msg = _error(_raw(eval={"datasets": [{"name": "a", "path": "x.jsonl"}, {"name": "a", "path": "y.jsonl"}]}))
    assert "eval.datasets" in msg and "unique" in msg


def test_error_message_names_the_file(tmp_path):
    path = _write(tmp_path, "model:\n  path: m\nrollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "rollout.temprature: unknown field" in str(info.value)


def test_validate_assignment_rejects_bad_values():
    cfg = config_from_dict(MINIMAL)
    with pytest.raises(ValueError):
        cfg.rollout.temperature = 0


def test_needs_ref_model():
    assert config_from_dict(_raw(algorithm={"kl_loss_coef": 0.1})).algorithm.needs_ref_model
    assert config_from_dict(_raw(algorithm={"log_kl": True})).algorithm.needs_ref_model


# --------------------------------------------------------------------------- #
# overrides
# --------------------------------------------------------------------------- #


def test_override_float_bool_list():
    cfg = load_config(None, ["model.path=m", "rollout.temperature=0.7", "cluster.colocate=false",
                             "rollout.stop_token_ids=[1,2]", "seed=3"])
    assert cfg.rollout.temperature == 0.7 and isinstance(cfg.rollout.temperature, float)
    assert cfg.cluster.colocate is False
    assert cfg.rollout.stop_token_ids == [1, 2]
    assert cfg.seed == 3


def test_override_parses_values_with_yaml_typing():
    raw = apply_overrides({}, ["a.f=0.7", "a.b=false", "a.l=[1,2]", "a.i=3", "a.s=text", "a.e=", "a.eq=x=y"])
    assert raw == {"a": {"f": 0.7, "b": False, "l": [1, 2], "i": 3, "s": "text", "e": "", "eq": "x=y"}}
    assert isinstance(raw["a"]["f"], float) and isinstance(raw["a"]["b"], bool)


def test_override_creates_nested_sections():
    raw = apply_overrides({"model": {"path": "m"}}, ["checkpoint.save_interval=5", "x.y.z=1"])
    assert raw["checkpoint"] == {"save_interval": 5}
    assert raw["x"] == {"y": {"z": 1}}
    assert raw["model"] == {"path": "m"}


def test_override_indexes_a_list_and_keeps_the_item_fields():
    raw = {"eval": {"datasets": [{"name": "a", "path": "x", "reward": "exact_match"}]}}
    apply_overrides(raw, ["eval.datasets.0.path=y"])
    assert raw["eval"]["datasets"] == [{"name": "a", "path": "y", "reward": "exact_match"}]
    with pytest.raises(ConfigError, match="eval.datasets is a list of 1 items; '1' is not the index"):
        apply_overrides(raw, ["eval.datasets.1.path=z"])


def test_override_wins_over_file(tmp_path):
    path = _write(tmp_path, "model:\n  path: m\nrollout:\n  temperature: 0.9\n  top_k: 5\n")
    cfg = load_config(path, ["rollout.temperature=0.5"])
    assert cfg.rollout.temperature == 0.5
    assert cfg.rollout.top_k == 5  # siblings from the file are kept


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="rollout.temperature"):
        load_config(None, ["model.path=m", "rollout.temperature"])


def test_override_into_a_value_is_an_error(tmp_path):
    path = _write(tmp_path, "model:\n  path: m\nseed: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["seed.x=1"])
    assert "seed" in str(info.value)
    # Without the value in the file the new "section" fails validation instead, still naming the field.
    with pytest.raises(ConfigError, match="seed"):
        load_config(None, ["model.path=m", "seed.x=1"])


def test_override_with_unknown_field_is_reported():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.path=m", "rollout.temprature=0.7"])
    assert "rollout.temprature: unknown field" in str(info.value)
    assert "rollout.temprature=0.7" in str(info.value)  # the source names the override


# --------------------------------------------------------------------------- #
# files
# --------------------------------------------------------------------------- #


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_invalid_yaml(tmp_path):
    path = _write(tmp_path, "model: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "YAML" in str(info.value)


def test_top_level_list(tmp_path):
    path = _write(tmp_path, "- model\n- rollout\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "mapping" in str(info.value)


def test_empty_file_reports_missing_model(tmp_path):
    path = _write(tmp_path, "")
    with pytest.raises(ConfigError, match="model"):
        load_config(path)


def test_dump_round_trips(tmp_path):
    raw = _raw(
        seed=7,
        output_dir=str(tmp_path / "run"),
        cluster={"num_train_actors": 2, "offload": True},
        rollout={"temperature": 0.7, "top_p": 0.9, "stop_token_ids": [5, 6], "prompts_per_rollout": 4,
                 "n_samples_per_prompt": 4},
        train={"global_batch_size": 8, "lr": 1e-6, "adam_eps": 1e-8, "lr_schedule": "cosine"},
        eval={"interval": 2, "datasets": [{"name": "a", "path": "a.jsonl", "temperature": 0.0, "reward": "f1"},
                                          {"name": "b", "path": "b.jsonl", "top_k": 3}]},
        checkpoint={"load": "ckpts", "save_interval": 3},
    )
    cfg = config_from_dict(raw)
    text = dump_config(cfg)
    assert config_from_dict(yaml.safe_load(text)) == cfg
    path = _write(tmp_path, text, "dumped.yaml")
    assert load_config(path) == cfg
    # The default config round-trips too.
    default = config_from_dict(MINIMAL)
    assert load_config(_write(tmp_path, dump_config(default), "default.yaml")) == default


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #


@pytest.fixture
def recipe(tmp_path) -> Path:
    return _write(tmp_path, "model:\n  path: some/model\nrollout:\n  temperature: 0.9\n")


def test_cli_dry_run_prints_resolved_yaml(recipe, capsys):
    assert main(["train", "--config", str(recipe), "--dry-run", "rollout.temperature=0.5"]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert printed["rollout"]["temperature"] == 0.5
    assert printed["model"]["path"] == "some/model"
    assert config_from_dict(printed) == load_config(recipe, ["rollout.temperature=0.5"])


def test_cli_sft_dry_run(recipe, capsys):
    assert main(["sft", "-c", str(recipe), "--dry-run", "sft.batch_size=4"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["sft"]["batch_size"] == 4


def test_cli_bad_override_returns_2(recipe, capsys):
    assert main(["train", "--config", str(recipe), "--dry-run", "rollout.temprature=0.5"]) == 2
    captured = capsys.readouterr()
    assert "rollout.temprature" in captured.err
    assert "unknown field" in captured.err
    assert captured.out == ""


def test_cli_missing_config_file_returns_2(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "missing.yaml"), "--dry-run"]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_cli_load_sets_checkpoint_load(recipe, tmp_path, capsys):
    ckpt = tmp_path / "run" / "checkpoints"
    assert main(["train", "--config", str(recipe), "--dry-run", "--load", str(ckpt)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["checkpoint"]["load"] == str(ckpt)


def test_cli_overrides_may_follow_options(recipe, tmp_path, capsys):
    ckpt = tmp_path / "run" / "checkpoints"
    assert main(["train", "--config", str(recipe), "seed=3", "--load", str(ckpt), "rollout.num_rollout=36",
                 "--dry-run"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert (out["seed"], out["rollout"]["num_rollout"], out["checkpoint"]["load"]) == (3, 36, str(ckpt))
    with pytest.raises(SystemExit):
        main(["train", "--config", str(recipe), "--load", str(ckpt), "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["run #3", "2024"])
def test_cli_load_keeps_the_path_verbatim(recipe, tmp_path, capsys, name):
    ckpt = str(tmp_path / name) if name.startswith("run") else name
    assert main(["train", "--config", str(recipe), "--dry-run", "--load", ckpt]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["checkpoint"]["load"] == ckpt


# --------------------------------------------------------------------------- #
# field descriptions (the config reference is generated from them)
# --------------------------------------------------------------------------- #


def _section_classes() -> list[type[Section]]:
    found, todo = [], [Section]
    while todo:
        for sub in todo.pop().__subclasses__():
            # Every section in the package: config.py assembles sections that live beside their components.
            if sub.__module__.startswith("tether.") and sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


def test_section_classes_are_found():
    names = {cls.__name__ for cls in _section_classes()}
    assert {"ClusterConfig", "RolloutConfig", "EvalDatasetConfig", "TetherConfig"} <= names


@pytest.mark.parametrize("cls", [c for c in _section_classes() if c is not TetherConfig], ids=lambda c: c.__name__)
def test_every_section_field_has_a_description(cls):
    missing = [name for name, field in cls.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"{cls.__name__} fields without a description: {missing}"


def test_top_level_fields_have_descriptions():
    missing = [name for name, field in TetherConfig.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"TetherConfig fields without a description: {missing}"


def test_engines_on_other_interfaces_need_an_api_key(monkeypatch):
    monkeypatch.delenv("TETHER_API_KEY", raising=False)
    err = _error(_raw(engine={"host": "0.0.0.0"}))
    assert "engine.host=0.0.0.0" in err and "cluster.api_key" in err
    config_from_dict(_raw(engine={"host": "0.0.0.0"}, cluster={"api_key": "k"}))
    monkeypatch.setenv("TETHER_API_KEY", "k")
    config_from_dict(_raw(engine={"host": "0.0.0.0"}))


def test_the_api_key_never_reaches_written_config():
    cfg = config_from_dict(_raw(cluster={"api_key": "s3cret"}))
    assert cfg.cluster.api_key == "s3cret"  # the run itself has it
    text = dump_config(cfg)
    assert "s3cret" not in text and "<redacted>" in text
    assert config_mod.public_dict(cfg)["cluster"]["api_key"] == "<redacted>"


def test_server_limits_are_validated_naming_the_field():
    assert "server.max_request_mb" in _error(_raw(server={"max_request_mb": 0}))
    assert "server.max_queued_requests" in _error(_raw(server={"max_queued_requests": 0}))
    err = _error(_raw(cluster={"router": "sglang_router"}, server={"require_key_for_generate": True}))
    assert "server.require_key_for_generate" in err


def test_the_config_loads_and_validates_without_torch():
    # --dry-run and every launcher read the config first: it must not pay for (or need) torch.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys; sys.modules['torch'] = None\n"
            "from tether.config import load_config\n"
            "for recipe in ('arithmetic/grpo.yaml', 'calculator/grpo.yaml', 'reasoning_gym/grpo.yaml'):\n"
            "    load_config(f'recipes/{recipe}', ['algorithm.policy_loss=gspo', 'algorithm.advantage_estimator=gae',\n"
            "                                      'algorithm.kl_in_reward_coef=0.1'])\n"
            "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_component_section_imports_first_in_a_fresh_process():
    # A Ray actor's process imports its own module first (the vLLM actor: tether.engine.vllm), whose
    # section imports tether.config.base while the tree imports the sections: neither order may cycle.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for module in ("tether.engine.config", "tether.rollout.config", "tether.engine.backends", "tether.cluster"):
        code = f"import sys; sys.modules['torch'] = None\nimport {module}\nfrom tether.config import TetherConfig"
        out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (module, out.stderr[-2000:])


def test_the_names_the_config_checks_are_the_registered_ones():
    import typing

    from tether.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from tether.algorithms.losses import POLICY_LOSSES
    from tether.algorithms.names import NEEDS_VALUES, POLICY_LOSS_NAMES, TOKEN_LEVEL
    from tether.config import AlgorithmConfig

    assert set(POLICY_LOSSES) == set(POLICY_LOSS_NAMES)
    estimators = set(typing.get_args(AlgorithmConfig.model_fields["advantage_estimator"].annotation))
    assert estimators == set(ADVANTAGE_ESTIMATORS) and TOKEN_LEVEL | NEEDS_VALUES <= estimators


def test_an_optional_package_the_config_needs_is_named_before_anything_starts(tmp_path, monkeypatch):
    import importlib.util

    from tether.run.preflight import check_inputs

    (tmp_path / "m").mkdir()
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = config_from_dict({"model": {"path": str(tmp_path / "m")}, "data": {"path": str(tmp_path / "d.jsonl")},
                            "tracking": {"wandb": True}, "cluster": {"router": "sglang_router"}})
    check_inputs(cfg, "train")  # both installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "sglang_router")
                        else real(name, *a))
    with pytest.raises(ConfigError) as err:
        check_inputs(cfg, "train")
    text = str(err.value)
    assert "tracking.wandb=true: needs the 'wandb' package" in text and "pip install 'wandb>=0.17'" in text
    assert "cluster.router=sglang_router: needs the 'sglang_router' package" in text


def test_cli_export_and_serve_name_bad_input_without_a_traceback(tmp_path, capsys):
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint nor a directory holding a complete one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(tmp_path), "--dtype", "float16"])
    assert "argument --dtype: invalid choice: 'float16'" in capsys.readouterr().err


@pytest.mark.parametrize("old, words", [
    ({"rollout": {"max_staleness": 2, "async_mode": "fully_async", "pause_mode": "recompute"}},
     ["rollout.max_staleness, rollout.async_mode, rollout.pause_mode moved into rollout.schedule",
      "rollout: {schedule: {mode: fully_async, max_staleness: 2, pause_mode: recompute}}"]),
    ({"rollout": {"max_staleness": 1}}, ["rollout: {schedule: {mode: one_step_off}}"]),
    ({"rollout": {"max_staleness": 0, "stale_groups": "drop"}}, ["rollout: {schedule: {mode: sync}}"]),
    ({"rollout": {"engine": "vllm", "engine_host": "0.0.0.0"}},
     ["rollout.engine, rollout.engine_host moved to the engine section", "engine: {backend: vllm, host: 0.0.0.0}"]),
    ({"rollout": {"external_engines": ["http://a:1"]}}, ["engine: {urls: ['http://a:1'], backend: external}"]),
    ({"rollout": {"max_batch_tokens": 4096}}, ["engine: {max_batch_tokens: 4096}"]),
    ({"vllm": {"max_model_len": 512}}, ["the vllm section(s) moved into the engine section",
                                        "engine: {backend: vllm, <the same fields>}"]),
])
def test_older_spellings_get_the_new_one_with_their_values(old, words):
    err = _error(_raw(**old))
    assert all(w in err for w in words), err


def test_schedule_and_engine_unions_pick_their_variant_from_their_key():
    cfg = load_config(None, ["model.path=m", "cluster.colocate=false", "rollout.schedule.mode=fully_async",
                             "rollout.schedule.max_staleness=3", "engine.backend=vllm", "engine.max_model_len=512"])
    assert (cfg.rollout.schedule.mode, cfg.rollout.schedule.max_staleness) == ("fully_async", 3)
    assert (cfg.engine.backend, cfg.engine.max_model_len, cfg.engine.host) == ("vllm", 512, "127.0.0.1")
    plain = config_from_dict(_raw(engine={"max_batch_tokens": 4096}))  # no backend: the default one's settings
    assert (plain.engine.backend, plain.engine.max_batch_tokens, plain.rollout.schedule.max_staleness) == ("embedded", 4096, 0)
    assert config_from_dict(_raw(rollout={"schedule": {"mode": "one_step_off"}}, cluster={"colocate": False})
                            ).rollout.schedule.max_staleness == 1
    assert "engine.embedded.max_model_len" in _error(_raw(engine={"max_model_len": 512}))  # vllm's field
    # The dump reloads as the same config (what checkpoints store and resume compares).
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert again == cfg


def test_every_engine_backend_has_one_descriptor():
    from typing import get_args

    from tether.engine.backends import BACKENDS
    from tether.engine.config import EngineConfig

    variants = get_args(get_args(EngineConfig)[0])
    assert {v.model_fields["backend"].default: v for v in variants} == {k: b.config for k, b in BACKENDS.items()}


def test_args_take_any_keys_from_the_file_and_the_command_line():
    cfg = load_config(None, ["model.path=m", "args.table=data/t.json", "args.limits.calls=3"])
    assert cfg.args == {"table": "data/t.json", "limits": {"calls": 3}}
