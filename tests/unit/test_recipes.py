"""The math_word recipe and the learning suite: their data is what the READMEs say, and their
configs load against it. (The runs themselves are measured by bench/learning.py, not here.)"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from tether.config import load_config
from tether.rewards.builtin import math_reward
from tether.rollout.prompt_format import render_prompt, round_trip_problems, PromptFormat
from tether.sample import Sample
from tether.models.tiny import build_char_tokenizer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def load_module(path: Path):
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"recipe_{path.parent.name}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def scored(response: str, label: str) -> float:
    return math_reward(Sample(prompt_index=0, sample_index=0, prompt="", label=label, metadata={},
                              prompt_ids=[1], response_text=response))


def test_math_word_teacher_is_wrong_where_the_words_say_so(tmp_path):
    prepare = load_module(RECIPES / "math_word" / "prepare.py")
    rng = random.Random(0)
    for kind in prepare.KINDS:
        text, a, true, sloppy = prepare.make_problem(rng, kind)
        worked, answer = prepare.solve(a, true)
        assert scored(worked, str(answer)) == 1.0, (kind, worked)
        if kind != "add":  # adding everything is right only for buying problems
            assert true != sloppy
    prepare.make_data(tmp_path, seed=0, sloppiness=0.7, num_train=100, num_sft=50, num_eval=20)
    train, held_out = rows(tmp_path / "train.jsonl"), rows(tmp_path / "eval.jsonl")
    assert not {json.dumps(r["prompt"]) for r in train} & {json.dumps(r["prompt"]) for r in held_out}
    assert held_out[0]["prompt"][0] == {"role": "system", "content": prepare.SYSTEM}
    # The chat-templated prompts and the worked answers survive the tokenizer unchanged.
    tokenizer = build_char_tokenizer(chat_template=True)
    fmt = PromptFormat(apply_chat_template=True)
    texts = [("eval.jsonl", "prompt", render_prompt(tokenizer, r["prompt"], fmt)) for r in held_out]
    texts += [("sft.jsonl", "response", r["response"]) for r in rows(tmp_path / "sft.jsonl")]
    assert round_trip_problems(tokenizer, texts) == []


@pytest.mark.parametrize("config", ["sft.yaml", "grpo.yaml"])
def test_math_word_configs_load(config):
    cfg = load_config(RECIPES / "math_word" / config)
    assert cfg.data.apply_chat_template
    assert all((d.reward or cfg.rollout.reward) == "math" for d in cfg.eval.datasets)


def test_suite_teachers_change_nearly_every_answer():
    tasks = load_module(RECIPES / "suite" / "tasks.py")
    assert len(tasks.TASKS) >= 4 and len({t.kind for t in tasks.TASKS.values()}) == len(tasks.TASKS)
    rng = random.Random(0)
    for task in tasks.TASKS.values():
        problems = [task.make(rng) for _ in range(300)]
        wrong = sum(task.sloppy(parts) != task.solve(parts) for _, parts in problems) / len(problems)
        # Parity's first digit agrees with its last half the time, max's largest last digit a third.
        assert wrong >= {"parity": 0.4, "max": 0.55}.get(task.name, 0.95), (task.name, wrong)


def test_suite_prepare_holds_out_the_eval_prompts(tmp_path):
    prepare = load_module(RECIPES / "suite" / "prepare.py")
    counts = prepare.make_data(prepare.TASKS["max"], tmp_path, seed=0, sloppiness=0.7, num_train=200,
                               num_eval=40, num_sft=100)
    assert counts == {"train": 200, "eval": 40, "sft": 100}
    train, held_out = rows(tmp_path / "train.jsonl"), rows(tmp_path / "eval.jsonl")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert held_out[0]["label"] == str(max(int(n) for n in held_out[0]["prompt"][4:-1].split()))
    tokenizer = build_char_tokenizer(chat_template=False)
    texts = [("eval.jsonl", "prompt", r["prompt"]) for r in held_out] + [("eval.jsonl", "label", r["label"])
                                                                         for r in held_out]
    assert round_trip_problems(tokenizer, texts) == []


@pytest.mark.parametrize("config", ["sft.yaml", "grpo.yaml"])
def test_suite_configs_load(config):
    cfg = load_config(RECIPES / "suite" / config, ["eval.datasets.0.path=elsewhere.jsonl"] if config == "grpo.yaml" else [])
    assert cfg.seed == 0


# ---------------------------------------------------------------- calculator (multi-turn, a tool)


def test_calculator_teacher_mix_and_held_out_eval(tmp_path):
    prepare = load_module(RECIPES / "calculator" / "prepare.py")
    reward = load_module(RECIPES / "calculator" / "reward.py")
    counts = prepare.make_data(tmp_path, seed=0, num_train=2000, num_sft=2000, num_eval=50)
    assert counts == {"train": 2000, "eval": 50, "sft": 2000}
    train, held_out, sft = rows(tmp_path / "train.jsonl"), rows(tmp_path / "eval.jsonl"), rows(tmp_path / "sft.jsonl")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert not {r["prompt"] for r in sft} & {r["prompt"] for r in held_out}
    labels = {r["prompt"]: r["label"] for r in train}
    kinds = {k: [r for r in sft if r["kind"] == k] for k in prepare.TEACHER_MIX}
    assert all(abs(len(kinds[k]) / len(sft) - p) < 0.04 for k, p in prepare.TEACHER_MIX.items())
    for row in sft:
        response = row["response"]
        text = response if isinstance(response, str) else "".join(s["text"] for s in response)
        right = reward.score(text, labels[row["prompt"]]) == 1.0
        assert right == (row["kind"] == "right"), row  # skipping and misusing the tool are (nearly) always wrong
        if not isinstance(response, str):  # the tool's output is never a target
            assert [s.get("train", True) for s in response] == [True, False, True]
    tokenizer = build_char_tokenizer(chat_template=False)
    texts = [("sft.jsonl", "response", s["text"]) for r in sft[:200] if isinstance(r["response"], list)
             for s in r["response"]] + [("eval.jsonl", "prompt", r["prompt"]) for r in held_out]
    assert round_trip_problems(tokenizer, texts) == []


@pytest.mark.parametrize("response, score", [
    ("<calc>347*58</calc><result>20126</result>20126", 1.0), ("20126", 1.0), (" 20126 ", 1.0),
    ("<calc>347*5</calc><result>1735</result>1735", 0.0), ("15000", 0.0),
    ("<calc>347*58</calc><result>20126</result>", 0.0),  # no answer after the result
    ("<calc>3*4</calc><result>12</result><calc>347*58</calc><result>20126</result>20126", 1.0),
    ("20126<calc>1</calc><result>1</result>1", 0.0),  # the answer is what follows the last result
])
def test_calculator_reward_reads_the_answer_after_the_last_result(response, score):
    reward = load_module(RECIPES / "calculator" / "reward.py")
    assert reward.score(response, "20126") == score


class ScriptedContext:
    """A generate function's context whose engine replies are scripted (text, "eos" | "stop" | "length"):
    the real generate_into / insert, no server."""

    def __new__(cls, tokenizer, replies, budget=None):
        from tether.rollout.generate_fn import GenerateContext, Generation

        class Scripted(GenerateContext):
            async def generate(self, input_ids, sampling_params):
                self.seen.append((list(input_ids), dict(sampling_params)))
                text, how = replies.pop(0)
                ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if how == "eos" else [])
                cut = text[: text.find("</calc>")] if how == "stop" else text  # as the engine cuts a stop string
                return Generation(ids, [-0.5] * len(ids), cut, "length" if how == "length" else "stop", 3)

        ctx = Scripted(url="", client=None, tokenizer=tokenizer, cfg=None, rollout_id=0, evaluation=False, rid="r",
                       seed=0, is_cut=lambda: False, timeout_s=1.0, budget=budget)
        ctx.seen = []
        return ctx


def run_agent(replies, max_new_tokens=64):
    import asyncio

    agent = load_module(RECIPES / "calculator" / "agent.py")
    tokenizer = build_char_tokenizer(chat_template=False)
    sample = Sample(prompt_index=0, sample_index=0, prompt="347*58=", label="20126", metadata={},
                    prompt_ids=tokenizer.encode("347*58=", add_special_tokens=False))
    ctx = ScriptedContext(tokenizer, list(replies), budget=max_new_tokens)  # as the rollout builds it
    out = asyncio.run(agent.generate(ctx, sample, {"temperature": 1.0, "max_new_tokens": max_new_tokens}))
    out.check_aligned()
    return out, ctx, tokenizer


def test_calculator_agent_inserts_the_result_masked():
    sample, ctx, tok = run_agent([("<calc>347*58</calc>", "stop"), ("20126", "eos")])
    assert sample.response_text == "<calc>347*58</calc><result>20126</result>20126"
    assert sample.loss_mask == [1] * 19 + [0] * 22 + [1] * 6  # the answer and its eos are trained on
    assert sample.metrics == {"tool_calls": 1.0, "turns": 2.0, "tool_errors": 0.0}
    assert all(params["stop"] == ["</calc>"] for _, params in ctx.seen)
    # The second turn continues from the prompt, the call and the inserted result, as tokens.
    assert tok.decode(ctx.seen[1][0]) == "347*58=<calc>347*58</calc><result>20126</result>"
    assert ctx.seen[1][1]["max_new_tokens"] == 64 - 19 - 22


def test_calculator_agent_without_a_call_and_with_a_bad_one():
    sample, _, _ = run_agent([("15000", "eos")])
    assert sample.response_text == "15000" and sample.loss_mask is None
    assert sample.metrics == {"tool_calls": 0.0, "turns": 1.0, "tool_errors": 0.0}
    sample, _, _ = run_agent([("<calc>347*</calc>", "stop"), ("58</calc>", "stop"), ("1", "eos")], max_new_tokens=200)
    assert sample.response_text == "<calc>347*</calc><result>error</result>58</calc><result>error</result>1"
    assert sample.metrics == {"tool_calls": 2.0, "turns": 3.0, "tool_errors": 2.0}


def test_calculator_agent_stops_at_the_budget_and_the_call_limit():
    sample, _, _ = run_agent([("<calc>347*58</calc>", "stop"), ("2012", "length")], max_new_tokens=45)
    assert sample.status == "truncated" and sample.metrics["tool_calls"] == 1.0
    # A result that does not fit in the budget is cut there: the response never outgrows it.
    sample, _, _ = run_agent([("<calc>347*58</calc>", "stop")], max_new_tokens=30)
    assert sample.status == "truncated" and sample.finish_reason == "length"
    assert sample.response_text == "<calc>347*58</calc><result>201" and sample.loss_mask == [1] * 19 + [0] * 11
    assert sample.metrics == {"tool_calls": 1.0, "turns": 1.0, "tool_errors": 0.0}
    agent = load_module(RECIPES / "calculator" / "agent.py")
    calls = [("<calc>1+1</calc>", "stop")] * (agent.MAX_CALLS + 1)
    sample, _, _ = run_agent(calls, max_new_tokens=200)
    assert sample.metrics == {"tool_calls": float(agent.MAX_CALLS), "turns": agent.MAX_CALLS + 1.0, "tool_errors": 0.0}
    assert sample.response_text.endswith("<result>2</result><calc>1+1</calc>")


@pytest.mark.parametrize("config", ["sft.yaml", "grpo.yaml"])
def test_calculator_configs_load_with_the_same_greedy_multi_turn_eval(config):
    cfg = load_config(RECIPES / "calculator" / config)
    assert cfg.rollout.custom_generate_fn == f"{(RECIPES / 'calculator' / 'agent.py').resolve()}:generate"
    [calc] = cfg.eval.datasets
    assert calc.temperature == 0.0 and calc.reward == f"{(RECIPES / 'calculator' / 'reward.py').resolve()}:score"


@pytest.mark.parametrize("replies, budget", [
    ([("<calc>347*58</calc>", "stop"), ("20126", "eos")], 64),
    ([("15000", "eos")], 64),
    ([("<calc>347*</calc>", "stop"), ("<calc>347*58</calc>", "stop"), ("20126", "eos")], 200),
    ([("<calc>1+1</calc>", "stop")] * 4, 200),
    ([("<calc>347*58</calc>", "stop")], 30),
])
def test_the_openai_client_agent_builds_the_samples_agent_py_does(replies, budget):
    """openai_agent.py (an OpenAI tool loop through a chat session, over real HTTP) and agent.py give the
    same tokens, loss mask and log-probs for the same engine replies."""
    import asyncio

    direct, _, tokenizer = run_agent(list(replies), max_new_tokens=budget)
    agent = load_module(RECIPES / "calculator" / "openai_agent.py")
    sample = Sample(prompt_index=0, sample_index=0, prompt="347*58=", label="20126", metadata={},
                    prompt_ids=tokenizer.encode("347*58=", add_special_tokens=False))
    ctx = ScriptedContext(tokenizer, list(replies), budget=budget)
    out = asyncio.run(agent.generate(ctx, sample, {"temperature": 1.0, "max_new_tokens": budget}))
    assert (out.prompt_ids, out.response_ids, out.loss_mask) == (direct.prompt_ids, direct.response_ids, direct.loss_mask)
    assert (out.response_logprobs, out.response_text, out.status) == (direct.response_logprobs, direct.response_text,
                                                                      direct.status)
    assert out.metrics["turns_not_extending"] == 0.0


def test_generate_into_ends_a_turn_at_a_delimiter_and_keeps_it_in_the_text():
    # The engine cuts a matched stop string from its text; the turn a generate function sees keeps it
    # (as its tokens do), so a parser looking for the closing delimiter finds it.
    import asyncio

    tokenizer = build_char_tokenizer(chat_template=False)
    sample = Sample(prompt_index=0, sample_index=0, prompt="1+1=", label="2", metadata={},
                    prompt_ids=tokenizer.encode("1+1=", add_special_tokens=False))
    ctx = ScriptedContext(tokenizer, [("<calc>1+1</calc>", "stop")])
    turn = asyncio.run(ctx.generate_into(sample, {"max_new_tokens": 32, "stop": "\n"}, stop=["</calc>"]))
    assert turn.text == "<calc>1+1</calc>" == sample.response_text and turn.finish_reason == "stop"
    assert ctx.seen[0][1]["stop"] == ["\n", "</calc>"]  # the turn's stops join the given ones


def test_calculator_env_recipe_pieces_fit_together(tmp_path):
    """The environment class, its tool-call reader, the reward and the teacher's conversations."""
    prepare = load_module(RECIPES / "calculator_env" / "prepare.py")
    env_module = load_module(RECIPES / "calculator_env" / "env.py")
    reward = load_module(RECIPES / "calculator_env" / "reward.py")
    env = env_module.CalculatorEnv()
    assert env.reset(prompt="347*58=", label="20126") is None and env.calculate("347*58") == "20126"
    assert env_module.parse_calc("<calc>347*58</calc>") == ("", [{"name": "calculate",
                                                                 "arguments": {"expression": "347*58"}}])
    assert env_module.parse_calc("20126") == ("20126", [])
    assert reward.score("<calc>347*58</calc>tool: 20126assistant: 20126", "20126") == 1.0
    assert reward.score("15000", "20126") == 0.0
    right = prepare.conversation(347, 58, "right")
    assert [m["role"] for m in right] == ["user", "assistant", "tool", "assistant"] and right[-1]["content"] == "20126"
    assert prepare.conversation(347, 58, "misuse")[1]["content"] == "<calc>347*5</calc>"
    tokenizer = build_char_tokenizer(chat_template=False)
    tokenizer.chat_template = prepare.CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(right, tokenize=False)
    assert text == "user: 347*58=<eos>assistant: <calc>347*58</calc><eos>tool: 20126<eos>assistant: 20126<eos>"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_skyrl_addition_recipe_rows_are_skyrls_and_its_teacher_speaks_to_the_environment(tmp_path):
    pytest.importorskip("skyrl_gym")
    prepare = load_module(RECIPES / "skyrl_addition" / "prepare.py")
    request = prepare.second_turn_request()
    assert "#### ANSWER" in request  # asked of the package's environment, not copied
    convo = prepare.teacher(37, 48, random.Random(1), 1.0, request)  # always forgets the carry
    assert convo == [{"role": "user", "content": "37+48="}, {"role": "assistant", "content": "#### 75"},
                     {"role": "user", "content": request}, {"role": "assistant", "content": "#### 75"}]
    assert prepare.teacher(37, 48, random.Random(1), 0.0, request)[1:] == [{"role": "assistant", "content": "#### 85"}]
    row = prepare.row(37, 48)
    assert row["env_class"] == "gsm8k_multi_turn" and row["reward_spec"]["ground_truth"] == "85"
