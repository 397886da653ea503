"""Served models without engines: the config section, the name lookup, how user functions get them,
and the check that finds a name the config does not serve."""

from __future__ import annotations

import pytest

from tether.config import ConfigError, config_from_dict
from tether.importing import with_args
from tether.rollout.served import names_used, unserved_names
from tether.served import MODELS, ServedModelError, ServedModels


def test_a_served_model_is_a_path_or_running_servers():
    cfg = config_from_dict({"model": {"path": "m"}, "served_models": {"judge": {"path": "j", "num_engines": 2},
                                                                       "rm": {"urls": ["http://10.0.0.2:30000"]}}})
    assert cfg.served_models["judge"].placed == 2 and cfg.served_models["rm"].placed == 0
    for bad, message in [({}, "give path .* or urls .*neither"),
                         ({"path": "j", "urls": ["http://h:1"]}, "not both"),
                         ({"urls": ["h:1"]}, "must be http"),
                         ({"path": "j", "num_engines": 0}, "greater than or equal to 1")]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({"model": {"path": "m"}, "served_models": {"judge": bad}})
    with pytest.raises(ConfigError, match="served_models: names are written as ctx.models"):
        config_from_dict({"model": {"path": "m"}, "served_models": {"my judge": {"path": "j"}}})


class _Client:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_an_unknown_name_lists_the_served_ones():
    models = ServedModels()
    first = _Client()
    models.set({"judge": first, "teacher": _Client()})
    assert models["judge"] is first and sorted(models) == ["judge", "teacher"]
    with pytest.raises(ServedModelError, match=r"no served model named 'juge': the run serves judge, teacher"):
        models["juge"]
    models.set({})
    assert first.closed  # a reconnect closes the clients it replaces
    with pytest.raises(ServedModelError, match="the run serves none"):
        models["judge"]


def test_functions_taking_models_get_the_run_s_served_models():
    def reward(response, label, models):
        return models

    async def generate(ctx, sample, sampling_params, args, models):
        return args, models

    assert with_args(reward, None)("r", "l") is MODELS
    bound = with_args(generate, {"k": 1})
    assert bound.keywords == {"models": MODELS, "args": {"k": 1}}
    plain = lambda sample: 1.0  # noqa: E731
    assert with_args(plain, {"k": 1}) is plain


SOURCE = '''
async def judge(prompt, response, models):
    a = await models["judge"].chat(prompt)
    b = models.get("rm")
    return a

async def generate(ctx, sample, params):
    return await ctx.models["teacher"].generate(sample.prompt)

def other(models):
    key = "dynamic"
    return models[key], models["elsewhere"]
'''


def test_names_used_are_found_per_function():
    assert names_used(SOURCE, "judge") == [(3, "judge"), (4, "rm")]
    assert names_used(SOURCE, "generate") == [(8, "teacher")]
    assert names_used(SOURCE, "other") == [(12, "elsewhere")]  # a name in a variable is only known at run time
    assert [name for _, name in names_used(SOURCE)] == ["judge", "rm", "teacher", "elsewhere"]


def test_unserved_names_name_the_field_file_and_line(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(SOURCE)
    problems = unserved_names({"rollout.reward": f"{path}:judge", "rollout.custom_generate_fn": f"{path}:generate"},
                              ["judge", "teacher"])
    assert problems == [f"rollout.reward: {path}:4 uses the served model 'rm', which the config does not serve "
                        "(served_models: judge, teacher)"]
