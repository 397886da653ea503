"""reasoning-gym as a prompt source: config, generated files, held-out eval sets, the reward, errors.
Against the real package (small sizes: the whole file runs in seconds)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tether.cli import main
from tether.config import ConfigError, DataConfig, config_from_dict, load_config
from tether.run.preflight import check_inputs
from tether.rewards import BUILTIN_REWARDS, compute_rewards
from tether.rewards.reasoning_gym import (extract_answer, reasoning_gym_format_reward, reasoning_gym_reward,
                                          task_checker)
from tether.rollout.data_source import DataSource, load_prompt_rows
from tether.rollout.reasoning_gym_data import TaskMix, _check_round_trip, generate, task_counts
from tether.rollout.reasoning_gym_files import materialise, rows
from tether.sample import Sample

# Small arithmetic: chain_sum with two 1-digit terms has only a few hundred distinct questions.
SMALL_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


class CharTokenizer:
    """What the prompt loader needs of a tokenizer, without loading one."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def recipe(tmp_path: Path, **data) -> dict:
    (tmp_path / "model").mkdir(parents=True, exist_ok=True)
    rg = {"tasks": ["chain_sum", "products"], "settings": {"chain_sum": SMALL_SUMS}, "size": 40, "seed": 3, **data}
    return {"model": {"path": str(tmp_path / "model")}, "output_dir": str(tmp_path / "out"),
            "data": {"reasoning_gym": rg},
            "rollout": {"reward": "reasoning_gym", "prompts_per_rollout": 4, "n_samples_per_prompt": 2},
            "eval": {"datasets": [{"name": "rg", "reasoning_gym": {"size": 12}},
                                  {"reasoning_gym": {"size": 12, "per_task": True}, "temperature": 0}]}}


def resolved(tmp_path: Path, **data):
    cfg = config_from_dict(recipe(tmp_path, **data))
    check_inputs(cfg, "train")
    return cfg


def read(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def sample(row: dict, response: str) -> Sample:
    return Sample(prompt_index=0, sample_index=0, prompt=row["prompt"], label=row["label"],
                  metadata=row["metadata"], prompt_ids=[], response_text=response)


# ---------------------------------------------------------------- config


def test_the_section_loads_from_yaml_with_overrides(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m}\nrollout: {reward: reasoning_gym}\n"
                    "data:\n  reasoning_gym:\n    tasks: [gcd]\n    settings: {chain_sum: {min_terms: 2}}\n"
                    "eval:\n  datasets:\n    - {reasoning_gym: {size: 20, per_task: true}}\n")
    cfg = load_config(path, ["data.reasoning_gym.tasks=[chain_sum,products]", "data.reasoning_gym.size=64"])
    rg = cfg.data.reasoning_gym
    assert rg.tasks == ["chain_sum", "products"] and rg.size == 64 and rg.settings == {"chain_sum": {"min_terms": 2}}
    assert load_config(path, ["data.reasoning_gym.tasks=chain_sum, leg_counting"]).data.reasoning_gym.tasks == [
        "chain_sum", "leg_counting"]
    assert main(["train", "--config", str(path), "--dry-run"]) == 0
    assert "reasoning_gym:" in capsys.readouterr().out


@pytest.mark.parametrize("change, field", [
    ({"data": {"reasoning_gym": {"tasks": ["gcd"], "size": 0}}}, "data.reasoning_gym.size"),
    ({"data": {"reasoning_gym": {"tasks": ["gcd"], "weights": {"gcd": 0}}}}, "data.reasoning_gym.weights.gcd"),
    ({"data": {"reasoning_gym": {"tasks": ["gcd", "gcd"]}}}, "listed more than once"),
    ({"data": {"path": "x.jsonl", "reasoning_gym": {"tasks": ["gcd"]}}}, "data.path or data.reasoning_gym"),
    ({"eval": {"datasets": [{"name": "a"}]}}, "give path or reasoning_gym"),
    ({"eval": {"datasets": [{"reasoning_gym": {"tasks": ["gcd"]}}]}}, "name is required"),
    ({"eval": {"datasets": [{"name": "a", "reasoning_gym": {}}]}}, "eval.datasets[0].reasoning_gym.tasks: required"),
    ({"data": {"reasoning_gym": {"tasks": ["gcd"]}},
      "eval": {"datasets": [{"name": "gcd", "path": "x"}, {"reasoning_gym": {"per_task": True}}]}}, "unique"),
])
def test_bad_sections_name_the_field(change, field):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": {"path": "m"}, **change})
    assert field in str(info.value)


@pytest.mark.parametrize("command", ["train", "rollout", "eval"])
def test_the_commands_generate_and_check_the_data_before_they_run(tmp_path, monkeypatch, command):
    import tether.cli
    from tether.models.tiny import build_char_tokenizer, build_tiny_model

    build_tiny_model(tmp_path / "model", build_char_tokenizer(), hidden_size=16, num_layers=1, num_heads=2,
                     num_kv_heads=1, intermediate_size=32, max_positions=1024)
    raw = recipe(tmp_path)
    (tmp_path / "run.yaml").write_text(json.dumps(raw))
    ran = []
    monkeypatch.setattr(tether.cli, "_run", lambda args, cfg: ran.append(cfg))
    assert main([command, "--config", str(tmp_path / "run.yaml")]) == 0
    cfg = ran[0]
    assert Path(cfg.data.path).is_file() and all(Path(d.path).is_file() for d in cfg.eval.datasets)


# ---------------------------------------------------------------- generated files


def test_files_are_deterministic_prompt_rows(tmp_path):
    cfg = resolved(tmp_path)
    assert cfg.data.reasoning_gym is None and Path(cfg.data.path).parent == tmp_path / "out" / "data"
    train = read(cfg.data.path)
    assert len(train) == 40
    for row in train:
        entry = row["metadata"]["entry"]
        assert row["prompt"] == entry["question"] and row["label"] == entry["answer"]
        assert row["metadata"]["task"] == entry["metadata"]["source_dataset"]
    assert {r["metadata"]["settings"] == SMALL_SUMS for r in train if r["metadata"]["task"] == "chain_sum"} == {True}
    # The same config elsewhere: byte-identical files, and the same names (the name holds the hash of the bytes).
    again = resolved(tmp_path / "again")
    assert Path(again.data.path).read_bytes() == Path(cfg.data.path).read_bytes()
    assert Path(again.data.path).name == Path(cfg.data.path).name
    assert resolved(tmp_path / "other", seed=4).data.path.rpartition("_")[2] != cfg.data.path.rpartition("_")[2]
    # The loader, the data source and the config's own re-validation (the rollout manager's copy) take them as they are.
    loaded = load_prompt_rows(cfg.data.path, CharTokenizer())
    assert len(loaded.rows) == 40 and loaded.rows[0].metadata["task"] in ("chain_sum", "products")
    assert len(DataSource(loaded.rows, prompts_per_rollout=4, n_samples_per_prompt=2, shuffle=True, seed=0)
               .next_samples()) == 8
    assert config_from_dict(cfg.model_dump(mode="json")).data.path == cfg.data.path


def test_a_resume_finds_the_same_files_unchanged(tmp_path):
    first = resolved(tmp_path)
    before = Path(first.data.path).stat().st_mtime_ns
    second = resolved(tmp_path)  # a resumed run starts from the recipe again
    assert second.model_dump() == first.model_dump()
    assert Path(second.data.path).stat().st_mtime_ns == before  # found, not written again
    materialise(second)  # already files: nothing to do
    assert second.model_dump() == first.model_dump()


def test_a_loader_given_an_unwritten_section_says_what_writes_it(tmp_path):
    from tether.rollout.data_checks import load_eval_rows, load_train_rows

    cfg = config_from_dict(recipe(tmp_path))  # not through check_inputs, as a program calling train(cfg) might
    with pytest.raises(ConfigError, match=r"^data.reasoning_gym: its problems are not written yet; .*check_inputs"):
        load_train_rows(cfg, CharTokenizer(), None)
    with pytest.raises(ConfigError, match=r"^eval.datasets\[0\].reasoning_gym: its problems are not written yet"):
        load_eval_rows(cfg, CharTokenizer(), None)


def test_weights_give_exact_counts():
    mix = TaskMix(("chain_sum", "products", "gcd"), 41, 0, "data.reasoning_gym", weights={"products": 3, "gcd": 0.5})
    assert task_counts(mix) == {"chain_sum": 9, "products": 27, "gcd": 5}
    problems = generate(mix)
    assert Counter(p.task for p in problems) == {"chain_sum": 9, "products": 27, "gcd": 5}
    assert [p.task for p in problems[:10]] != ["chain_sum"] * 9 + ["products"]  # shuffled: a file read in order mixes
    with pytest.raises(ConfigError, match=r"data.reasoning_gym.size: 3 problems leave none to gcd"):
        task_counts(TaskMix(("chain_sum", "gcd"), 3, 0, "data.reasoning_gym", weights={"chain_sum": 10}))


def test_adding_a_task_keeps_the_others_problems():
    alone = generate(TaskMix(("gcd",), 5, 7, "d"))
    mixed = generate(TaskMix(("products", "gcd"), 10, 7, "d"))
    assert sorted(p.entry["question"] for p in alone) == sorted(p.entry["question"] for p in mixed if p.task == "gcd")


def test_eval_sets_are_held_out_and_split_per_task(tmp_path):
    cfg = resolved(tmp_path, size=200)
    train = {r["prompt"] for r in read(cfg.data.path)}
    assert [d.name for d in cfg.eval.datasets] == ["rg", "chain_sum", "products"]
    assert cfg.eval.datasets[1].temperature == 0 and cfg.eval.datasets[1].reasoning_gym is None
    for d in cfg.eval.datasets:
        questions = [r["prompt"] for r in read(d.path)]
        assert not set(questions) & train and len(set(questions)) == len(questions)
    assert {r["metadata"]["task"] for r in read(cfg.eval.datasets[1].path)} == {"chain_sum"}
    assert len(read(cfg.eval.datasets[1].path)) + len(read(cfg.eval.datasets[2].path)) == 12


def test_an_eval_set_too_big_for_its_settings_is_refused(tmp_path):
    raw = recipe(tmp_path, tasks=["chain_sum"], settings={"chain_sum": {**SMALL_SUMS, "allow_negation": False}})
    raw["eval"]["datasets"] = [{"name": "rg", "reasoning_gym": {"size": 400}}]
    with pytest.raises(ConfigError, match=r"eval.datasets\[0\].reasoning_gym: chain_sum gave only \d+ of 400"):
        check_inputs(config_from_dict(raw), "train")


def test_per_task_names_take_the_set_name_as_prefix(tmp_path):
    raw = recipe(tmp_path)
    raw["eval"]["datasets"] = [{"name": "greedy", "reasoning_gym": {"tasks": "gcd,products", "size": 4, "per_task": True}}]
    cfg = config_from_dict(raw)
    check_inputs(cfg, "eval")
    assert [d.name for d in cfg.eval.datasets] == ["greedy_gcd", "greedy_products"]


def test_entries_that_do_not_survive_json_are_refused():
    class TupleChecker:  # like arc_agi: compares its metadata's tuples with a parsed answer
        def score_answer(self, answer, entry):
            return float(entry["metadata"]["grid"] == (1, 2))

    with pytest.raises(ConfigError, match="do not survive being written as JSON"):
        _check_round_trip(TupleChecker(), {"question": "q", "answer": "a", "metadata": {"grid": (1, 2)}}, "t")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("data, message", [
    ({"tasks": ["chain_summ"]}, r"data.reasoning_gym.tasks\[0\]: unknown reasoning-gym task 'chain_summ'; did you "
                                r"mean chain_sum"),
    ({"tasks": ["gcd"], "settings": {"gcdd": {}}}, r"data.reasoning_gym.settings.gcdd: unknown reasoning-gym task"),
    ({"tasks": ["chain_sum"], "settings": {"chain_sum": {"min_term": 2}}},
     r"data.reasoning_gym.settings.chain_sum.min_term: chain_sum has no such setting \(did you mean min_terms\?\)"),
    ({"tasks": ["chain_sum"], "settings": {"chain_sum": {"min_terms": 0}}},
     r"data.reasoning_gym.settings.chain_sum: chain_sum rejects \{'min_terms': 0\}: min_terms must be positive"),
    ({"tasks": ["chain_sum"], "settings": {"chain_sum": {"min_terms": "two"}}}, r"settings.chain_sum: chain_sum rejects"),
    ({"tasks": ["gcd"], "settings": {"gcd": {"seed": 1}}}, r"data.reasoning_gym.settings.gcd.seed: set by tether"),
    ({"tasks": ["decimal_arithmetic"], "settings": {"decimal_arithmetic": {"max_num_decimal_places": 2}}},
     r"settings.decimal_arithmetic: decimal_arithmetic cannot generate problems with .*ValueError: empty range"),
])
def test_unknown_tasks_and_settings_are_named_before_anything_starts(tmp_path, data, message):
    raw = recipe(tmp_path, **data)
    raw["eval"]["datasets"] = []
    with pytest.raises(ConfigError, match=message):
        check_inputs(config_from_dict(raw), "train")
    assert not (tmp_path / "out" / "data").exists()


# ---------------------------------------------------------------- reward


def problem(task: str, settings: dict | None = None) -> dict:
    mix = TaskMix((task,), 3, 11, "d", settings={task: settings} if settings else {})
    return rows(generate(mix), DataConfig())[0]


@pytest.mark.parametrize("task, sentence", [
    ("chain_sum", "The answer is: {}"),
    ("basic_arithmetic", "The result: 7 + 8 = {}"),
    ("products", "The product is **{}**."),
    ("leg_counting", "There are {} legs in total.\nA spider has 8 legs, a human 2."),
    ("gcd", "The GCD of these numbers is {}.\n\nTo find it, divide 841 by 29."),
])
def test_the_reward_scores_real_entries(task, sentence):
    row = problem(task)
    answer = row["label"]
    wrong = str(int(answer) + 1)
    assert reasoning_gym_reward(sample(row, answer)) == 1.0
    assert reasoning_gym_reward(sample(row, sentence.format(answer))) == 1.0
    assert reasoning_gym_reward(sample(row, f"Let me think.\n<answer>{answer}</answer>")) == 1.0
    assert reasoning_gym_reward(sample(row, f"so \\boxed{{{answer}}}")) == 1.0
    assert reasoning_gym_reward(sample(row, wrong)) == 0.0
    assert reasoning_gym_reward(sample(row, sentence.format(wrong))) == 0.0
    assert reasoning_gym_format_reward(sample(row, f"<answer>{answer}</answer>")) == 1.0
    assert reasoning_gym_format_reward(sample(row, answer)) == pytest.approx(0.9)
    assert reasoning_gym_format_reward(sample(row, f"<answer>{wrong}</answer>")) == pytest.approx(0.1)


def test_odd_output_scores_zero_and_never_raises():
    row = problem("gcd")
    odd = ["", "   \n\n", "<answer></answer>", "\\boxed{", "=", "answer is", "\x00\x01", "no digits here",
           "9" * 5000, "<answer>" * 100, "-" * 50, "1e999", "NaN"]
    assert compute_rewards(reasoning_gym_reward, [sample(row, text) for text in odd], "reasoning_gym") == [0.0] * len(odd)


def test_a_row_that_is_not_a_problem_is_an_error():
    plain = Sample(prompt_index=0, sample_index=0, prompt="1+1", label="2", metadata={}, prompt_ids=[],
                   response_text="2")
    with pytest.raises(ValueError, match="rows generated from data.reasoning_gym"):
        reasoning_gym_reward(plain)


def test_the_reward_checks_with_the_rows_settings():
    # Some checkers read their config (decimal_arithmetic rounds to max_num_decimal_places): the row carries it.
    row = problem("decimal_arithmetic", {"max_num_decimal_places": 4})
    assert row["metadata"]["settings"] == {"max_num_decimal_places": 4}
    assert reasoning_gym_reward(sample(row, row["label"])) == 1.0
    assert task_checker("decimal_arithmetic", json.dumps(row["metadata"]["settings"])).config.max_num_decimal_places == 4


def test_rewards_are_builtins():
    assert BUILTIN_REWARDS["reasoning_gym"] is reasoning_gym_reward
    assert BUILTIN_REWARDS["reasoning_gym_format"] is reasoning_gym_format_reward


@pytest.mark.parametrize("response, oracle, expected", [
    ("x <answer> 12 </answer> y <answer>13</answer>", "13", "13"),  # the last tag, stripped
    ("<answer>13 legs</answer>", "13", "13 legs"),                     # tags are taken as written
    ("\\boxed{\\frac{1}{2}}", "0.5", "\\frac{1}{2}"),
    ("Working...\nSo the final answer is 42.", "42", "42"),            # "answer is" anywhere, the last one
    ("4 + 5 = 9\nthen 9 = 3 * 3", "9", "9"),                           # "= X" on the first line only
    ("The GCD of 841 and 549 is 1.", "1", "1"),                        # numbers: the last of the first line
    ("It is 1,234,567 in all.", "1234567", "1234567"),
    ("It is -4.", "-4", "-4"),
    ("**dlrow**.\nmore", "dlrow", "dlrow"),                            # else the first line, cleaned
    ("Hello world.", "Hello world.", "Hello world."),                  # the period stays when the answer has one
    ("", "1", None),
])
def test_extraction_rules(response, oracle, expected):
    assert extract_answer(response, oracle) == expected
