"""Environments from other libraries through rollout.environment, against a real engine server (no Ray):
TRL environment classes and skyrl-gym (the real package) text environments, with exact tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_config
from tests.integration import user_envs  # noqa: E402
from tether.config import ConfigError, config_from_dict
from tether.engine.sampling import SamplingParams
from tether.envs.conversation import Conversation
from tether.rollout.config import generate_fn_spec
from tether.rollout.driver import GroupDriver, Schedule
from tether.rollout.failures import FailurePolicy
from tether.rollout.filters import keep_all
from tether.rollout.fleet import EngineFleet
from tether.rollout.generate_fn import CustomGenerate, GenerateContext
from tether.rollout.user_functions import check_user_functions
from tether.models.hf import load_tokenizer
from tether.sample import Sample

pytestmark = pytest.mark.integration
ENVS = Path(__file__).parent / "user_envs.py"
MOD = "tests.integration.user_envs"  # by module: the objects the test sees
N = 2


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """The tiny model's shape with room for a few turns and the messages between them (a GEM game's
    instructions are 600 characters: 1024 positions)."""
    from tether.models.tiny import build_char_tokenizer, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("env_model"), build_char_tokenizer(chat_template=True),
                            hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                            max_positions=1024, seed=0)


@pytest.fixture(scope="module")
def engine(long_model):
    from tests.conftest import engine_server

    with engine_server(long_model) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(long_model):
    return load_tokenizer(str(long_model))


def config(model_dir, addition_data, tmp_path, environment: dict, **rollout):
    raw = tiny_config(model_dir, addition_data, tmp_path / "run", rollout={"environment": environment, **rollout})
    return config_from_dict(raw)


def groups(count: int, prompt="2+2=", label="4", metadata=None):
    return [[Sample(prompt_index=k, sample_index=j, prompt=prompt, label=label,
                    metadata=dict(metadata or {"start": 3, "task": "count"}), prompt_ids=[], rollout_id=0)
             for j in range(N)] for k in range(count)]


async def keep_env_reward(samples):
    for s in samples:
        if s.reward is None and not s.failed:
            s.reward = 0.0


def run(engine, tokenizer, cfg, source, max_new_tokens=24, policy=None):
    custom = CustomGenerate(generate_fn_spec(cfg.rollout), tokenizer=tokenizer, cfg=cfg, policy=policy,
                            field="rollout.environment")
    driver = GroupDriver(EngineFleet([engine.url], timeout_s=60), timeout_s=60, custom=custom, policy=policy)
    schedule = Schedule(need=len(source), over_sampling_groups=len(source), max_concurrent_groups=None, waves=False)
    result = driver.run(iter(source), schedule, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens), 5,
                        keep_env_reward, keep_all, "env rollout")
    return [s for g in result.kept for s in g], driver.take_failures()


def spans(sample: Sample) -> list[tuple[int, int]]:
    """(mask, length) runs of the loss mask (one run of 1s when nothing was inserted)."""
    if sample.loss_mask is None:
        return [(1, sample.response_length)] if sample.response_length else []
    out: list[tuple[int, int]] = []
    for m in sample.loss_mask or []:
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


def pieces(tokenizer, sample: Sample) -> list[str]:
    """The response's text run by run of its loss mask (turns and inserted messages alternate)."""
    out, start = [], 0
    for _, n in spans(sample):
        out.append(tokenizer.decode(sample.response_ids[start:start + n], skip_special_tokens=True))
        start += n
    return out


def test_a_trl_environment_class_plays_its_episode(engine, tokenizer, long_model, addition_data, tmp_path):
    user_envs.RESETS.clear()
    cfg = config(long_model, addition_data, tmp_path, {"type": "trl", "factory": f"{MOD}:CounterEnv",
                                                            "max_turns": 3, "max_turn_tokens": 3,
                                                            "tool_parser": f"{MOD}:every_turn_adds"})
    samples, _ = run(engine, tokenizer, cfg, groups(2), max_new_tokens=60)
    assert len(samples) == 2 * N
    # reset got the row: its prompt, its label under data.label_key and its other fields
    assert user_envs.RESETS[0] == {"prompt": "2+2=", "label": "4", "start": 3, "task": "count"}
    for s in samples:
        # The prompt is the chat template's rendering, with reset's observation appended to the user message.
        assert tokenizer.decode(s.prompt_ids) == "user: 2+2= Start at 3.\nassistant: "
        assert s.metrics["turns"] == 3.0 and s.metrics["tool_calls"] == 2.0 and s.metrics["tool_errors"] == 0.0
        assert [m for m, _ in spans(s)] == [1, 0, 1, 0, 1]  # turn, tool answer, turn, tool answer, turn
        turn1, answer1, turn2, answer2, _ = pieces(tokenizer, s)
        # Each tool call added the turn's length to the counter (the parser's call); the reward is get_reward().
        assert answer1 == f"tool: {3 + len(turn1)}\nassistant: "
        assert answer2 == f"tool: {3 + len(turn1) + len(turn2)}\nassistant: "
        assert s.reward == 3 + len(turn1) + len(turn2)
        inserted = [k for k, m in enumerate(s.loss_mask) if m == 0]
        assert all(s.response_logprobs[k] == 0.0 for k in inserted)  # inserted: not sampled


def test_tool_errors_are_shown_to_the_model_and_infrastructure_errors_retried(engine, tokenizer, long_model,
                                                                          addition_data, tmp_path):
    cfg = config(long_model, addition_data, tmp_path, {"type": "trl", "factory": f"{MOD}:CounterEnv",
                                                            "max_turns": 2, "max_turn_tokens": 3,
                                                            "tool_parser": f"{MOD}:turn_adds_too_much"})
    samples, _ = run(engine, tokenizer, cfg, groups(1), max_new_tokens=200)
    s = samples[0]
    assert s.metrics["tool_errors"] == 2.0 and s.reward == 3.0  # neither call changed the counter
    inserted = tokenizer.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0])
    assert "{'error': 'too much'}" in inserted and "{'error': 'Tool missing not found.'}" in inserted
    cfg = config(long_model, addition_data, tmp_path, {"type": "trl", "factory": f"{MOD}:BrokenEnv",
                                                            "max_turns": 1})
    samples, log = run(engine, tokenizer, cfg, groups(1), policy=FailurePolicy(max_failed_frac=1.0))
    # Each sample's first attempt fails in reset and its second succeeds.
    assert not any(s.failed for s in samples) and log.retried["environment"] == N
    assert all(s.metrics["retries/environment"] == 1 for s in samples)


def test_environment_config_errors_are_named_before_the_start(long_model, addition_data, tmp_path):
    for environment, expect in [
        ({"type": "trl", "factory": f"{ENVS}:Nowhere"}, r"rollout.environment: .*Nowhere"),
        ({"type": "trl", "factory": f"{MOD}:NoDocstringEnv"}, r"tool method act: .*docstring"),
        ({"type": "skyrl_gym", "env_class": "chess"}, r"env_class 'chess' is not a registered skyrl-gym environment"),
        ({"type": "gem", "env_id": "game:GuessTheNumber-v0"},
         r"'game:GuessTheNumber-v0' is not a registered GEM environment; did you mean one of .*GuessTheNumber-v0-easy"),
    ]:
        cfg = config(long_model, addition_data, tmp_path, environment)
        with pytest.raises(ConfigError, match=expect):
            check_user_functions(cfg)
    with pytest.raises(ConfigError, match="rollout.environment and rollout.custom_generate_fn both generate"):
        config(long_model, addition_data, tmp_path, {"type": "trl", "factory": f"{MOD}:CounterEnv"},
               custom_generate_fn=f"{MOD}:CounterEnv")


def test_skyrl_gym_gsm8k_scores_each_episode(engine, tokenizer, long_model, addition_data, tmp_path):
    import skyrl_gym

    cfg = config(long_model, addition_data, tmp_path, {"type": "skyrl_gym"})
    # A SkyRL dataset row: chat prompt, env_class and reward_spec as fields of the row (here: the metadata).
    row = {"env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": "4"}}
    samples, _ = run(engine, tokenizer, cfg, groups(1, prompt=[{"role": "user", "content": "2+2?"}], label=None,
                                                    metadata=row))
    env = skyrl_gym.make("gsm8k", env_config={}, extras=row)
    for s in samples:
        assert s.metrics["turns"] == 1.0 and s.loss_mask is None  # one step: nothing inserted
        assert s.reward == env.step(s.response_text)["reward"]  # the package's own score of that text


def test_a_registered_skyrl_gym_environment_runs_several_turns(engine, tokenizer, long_model, addition_data,
                                                               tmp_path):
    import skyrl_gym

    if "tether_test_echo" not in skyrl_gym.registry:
        skyrl_gym.register(id="tether_test_echo", entry_point=user_envs.make_skyrl_echo_env())
    cfg = config(long_model, addition_data, tmp_path, {"type": "skyrl_gym", "env_class": "tether_test_echo",
                                                            "max_turns": 3, "max_turn_tokens": 4})
    samples, _ = run(engine, tokenizer, cfg, groups(1, label="7"), max_new_tokens=200)
    for s in samples:
        inserted = tokenizer.decode([t for t, m in zip(s.response_ids, s.loss_mask or []) if m == 0])
        turns = int(s.metrics["turns"])
        assert turns == 3 and s.metrics["echo_turns"] == 3.0  # 3 turns of at most 4 tokens, and the observations, fit in 200
        assert "user: turn 1 seen, go on\nassistant: " in inserted and "turn 2 seen" in inserted
        assert s.reward == pytest.approx(0.5 * s.metrics["echo_turns"])  # the steps' rewards, summed


def test_environment_messages_are_inserted_as_the_template_renders_them(smollm2_dir):
    """With a real chat template (SmolLM2's ChatML): the conversation's tokens are exactly the template's
    rendering of the whole conversation, although no turn was ever re-rendered."""
    tok = load_tokenizer(str(smollm2_dir))
    ctx = GenerateContext(url="", client=None, tokenizer=tok, cfg=None, rollout_id=0, evaluation=False, rid="r",
                          seed=0, is_cut=lambda: False, timeout_s=1.0, budget=None)
    sample = Sample(0, 0, "", None, {}, [])
    talk = Conversation(ctx, sample, {"max_new_tokens": 100})
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    talk.start(messages)
    reply = tok.encode("Calling the tool.<|im_end|>", add_special_tokens=False)
    sample.add_generated(reply, [-0.5] * len(reply), "Calling the tool.", 0)
    observation = [{"role": "user", "content": "The tool says 5."}]
    talk.add(observation)
    whole = tok.apply_chat_template(messages + [{"role": "assistant", "content": "Calling the tool."}] + observation,
                                    add_generation_prompt=True, tokenize=False)
    assert tok.decode(sample.prompt_ids + sample.response_ids) == whole
    assert sample.loss_mask == [1] * len(reply) + [0] * (sample.response_length - len(reply))


# ---------------------------------------------------------------- OpenEnv: a real openenv-core server
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def openenv_server():
    """openenv_guess_server.py served by uvicorn in openenv-core's own environment."""
    import subprocess
    import time

    import httpx

    from tests.conftest import openenv_python_or_skip

    python, port = openenv_python_or_skip(), free_port()
    proc = subprocess.Popen([str(python), "-m", "uvicorn", "openenv_guess_server:app", "--port", str(port),
                             "--log-level", "warning"], cwd=Path(__file__).parent)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the OpenEnv server did not start"
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


def openenv(url, **more) -> dict:
    return {"type": "openenv", "url": url, "action": f"{MOD}:guess_of", "observation_key": "text",
            "max_turns": 3, "max_turn_tokens": 2, **more}


def test_an_openenv_server_plays_episodes_over_its_websocket(engine, tokenizer, long_model, addition_data, tmp_path,
                                                             openenv_server):
    url, _ = openenv_server
    cfg = config(long_model, addition_data, tmp_path, openenv(url))
    samples, _ = run(engine, tokenizer, cfg, groups(2, prompt="n"), max_new_tokens=60)
    assert len(samples) == 2 * N
    for s in samples:
        # The first observation is appended to the prompt; each step's answer is inserted, not trained on.
        assert tokenizer.decode(s.prompt_ids) == "user: n\n1-9?\nassistant: "
        parts = pieces(tokenizer, s)
        turns, answers = parts[0::2], parts[1::2]
        assert 1 <= s.metrics["turns"] == len(turns) <= 3 and s.metrics["env_steps"] == len(turns)
        hints = [a.split("\n")[0].removeprefix("user: ") for a in answers]
        assert set(hints) <= {"up", "down"} and len(hints) == len(turns) - 1  # "yes" ends it: never shown
        guesses = [user_envs.guess_of(t)["guess"] for t in turns]
        # The targets the server's answers allow; a reward of 1 means the last guess was it.
        targets = {t for t in range(1, 10) if all(t > g if h == "up" else t < g for g, h in zip(guesses, hints))}
        assert s.reward in (0.0, 1.0) and targets
        assert (guesses[-1] in targets) if s.reward == 1.0 else (len(turns) == 3 or s.status == "truncated")
    # One seed per prompt: the samples of a group play the same target, so their hints agree.
    for k in range(2):
        said = {}
        for s in samples[k * N:(k + 1) * N]:
            turns, answers = pieces(tokenizer, s)[0::2], pieces(tokenizer, s)[1::2]
            for t, a in zip(turns, answers):
                said.setdefault(user_envs.guess_of(t)["guess"], set()).add(a.split("\n")[0])
        assert all(len(h) == 1 for h in said.values()), said


def test_an_openenv_server_that_does_not_answer_or_is_gone_fails_the_sample(engine, tokenizer, long_model,
                                                                         addition_data, tmp_path, openenv_server):
    url, proc = openenv_server
    lenient = FailurePolicy(max_failed_frac=1.0, min_trained_frac=0.0, max_attempts=2, replace_groups=False)
    cfg = config(long_model, addition_data, tmp_path, openenv(url, action=f"{MOD}:slow_guess", message_timeout_s=0.5))
    samples, log = run(engine, tokenizer, cfg, groups(1, prompt="n"), max_new_tokens=60, policy=lenient)
    assert all(s.failed and s.failure["kind"] == "environment" and s.failure["attempts"] == 2 for s in samples)
    assert f"OpenEnv server {url}: no answer to step within 0.5s" in samples[0].failure["error"]
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = config(long_model, addition_data, tmp_path, openenv(gone, connect_timeout_s=0.5))
    samples, log = run(engine, tokenizer, cfg, groups(1, prompt="n"), max_new_tokens=60, policy=lenient)
    assert all(s.failed and s.failure["kind"] == "environment" for s in samples)
    assert f"OpenEnv server {gone}: no connection to ws://" in samples[0].failure["error"]
    assert "is it running?" in samples[0].failure["error"] and log.failed == {"environment": N}


# ---------------------------------------------------------------- GEM (the gem-llm package)
def test_a_gem_game_is_played_as_the_package_plays_it(engine, tokenizer, long_model, addition_data, tmp_path):
    """Each episode, replayed move for move on a fresh environment of the package with the same seed,
    gives the observations the sample holds and its reward."""
    import gem

    from tether.envs.gem import seed_of

    cfg = config(long_model, addition_data, tmp_path, {"type": "gem", "env_id": "game:GuessTheNumber-v0-easy",
                                                        "max_turns": 3, "max_turn_tokens": 4})
    samples, _ = run(engine, tokenizer, cfg, groups(2, prompt=""), max_new_tokens=200)
    seeds = {seed_of(cfg.seed, s) for s in samples}
    assert len(seeds) == 2  # one game per prompt, shared by its group
    for s in samples:
        env = gem.make("game:GuessTheNumber-v0-easy")
        observation, info = env.reset(seed=seed_of(cfg.seed, s))
        assert tokenizer.decode(s.prompt_ids) == f"user: {observation}\n{info['suffix']}\nassistant: "
        parts = pieces(tokenizer, s)
        turns, answers = parts[0::2], parts[1::2]
        total, shown = 0.0, []
        for turn in turns:
            observation, reward, terminated, truncated, info = env.step(turn)
            total += reward
            if terminated or truncated:
                break
            shown.append(f"user: {observation}\n{info['suffix']}\nassistant: ")
        assert answers == shown[:len(answers)] and s.metrics["env_steps"] == len(turns)
        assert s.reward == pytest.approx(total)


def test_a_registered_gem_environment_runs_several_turns(engine, tokenizer, long_model, addition_data, tmp_path):
    import gem
    from gem.envs.registration import ENV_REGISTRY

    from tether.envs.gem import seed_of

    if "tether:counting-v0" not in ENV_REGISTRY:
        gem.register("tether:counting-v0", entry_point=user_envs.make_gem_counting_env())
    cfg = config(long_model, addition_data, tmp_path, {"type": "gem", "env_id": "tether:counting-v0", "max_turns": 5,
                                                        "max_turn_tokens": 3})
    samples, _ = run(engine, tokenizer, cfg, groups(1, prompt="play"), max_new_tokens=120)
    for s in samples:
        parts = pieces(tokenizer, s)
        turns, answers = parts[0::2], parts[1::2]
        assert len(turns) == 3 and s.metrics["env_steps"] == 3  # the environment ended it at its third move
        assert tokenizer.decode(s.prompt_ids) == f"user: play\nseed {seed_of(cfg.seed, s) % 100} go\nmove?\nassistant: "
        assert answers == [f"user: got {len(t)}\nmove?\nassistant: " for t in turns[:2]]
        assert s.reward == pytest.approx(0.25 * sum(bool(t) for t in turns))


def test_a_verl_reward_model_named_whole_as_the_label_is_pointed_out(long_model, addition_data, tmp_path):
    import json

    from tether.rollout.manager import RolloutManager

    rows = tmp_path / "verl.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{k}+1=", "data_source": "add", "extra_info": {"index": k},
                                        "reward_model": {"style": "rule", "ground_truth": str(k + 1)}}) + "\n"
                            for k in range(4)))
    raw = tiny_config(long_model, addition_data, tmp_path / "run", rollout={"reward": f"{MOD}:every_turn_adds"},
                      eval={"datasets": []})
    raw["data"].update(path=str(rows), label_key="reward_model")
    info = RolloutManager(config_from_dict(raw).model_dump(mode="json")).data_info()
    assert any("data.label_key 'reward_model' gives a dict with a ground_truth field" in w
               and "set data.label_key=reward_model.ground_truth" in w for w in info["warnings"]), info["warnings"]
    raw["data"]["label_key"] = "reward_model.ground_truth"
    manager = RolloutManager(config_from_dict(raw).model_dump(mode="json"))
    assert not any("ground_truth field" in w for w in manager.data_info()["warnings"])
    row = manager.data.rows[0]
    assert row.label == "1" and row.metadata == {"data_source": "add", "extra_info": {"index": 0}}


# ---------------------------------------------------------------- verifiers (in its own Python environment)
# Every message ends with the end-of-turn token, as ChatML's <|im_end|>: a turn's tokens, cut by max_tokens
# or ended by the model, are a prefix of the conversation the template renders next.
EOS_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}<eos>{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")

def vf_config(long_model, addition_data, tmp_path, **more):
    from tests.conftest import verifiers_python_or_skip

    env = {"type": "verifiers", "env_id": "vf-tiny-env", "python": str(verifiers_python_or_skip()),
           "cwd": str(Path(__file__).parent), "sampling_args": {"max_tokens": 4}, "chat_template": EOS_TEMPLATE,
           **more}
    raw = tiny_config(long_model, addition_data, tmp_path / "run", rollout={"environment": env}, eval={"datasets": []})
    raw["data"] = {"path": None, "apply_chat_template": True}
    return config_from_dict(raw)


def test_a_verifiers_environment_brings_its_dataset_and_rubric(engine, tokenizer, long_model, addition_data,
                                                               tmp_path):
    import json

    from tether.run.preflight import write_environment_data

    cfg = vf_config(long_model, addition_data, tmp_path, eval_name="vf")
    write_environment_data(cfg)
    rows = [json.loads(line) for line in Path(cfg.data.path).read_text().splitlines()]
    assert rows[1] == {"prompt": [{"role": "user", "content": "1+1="}], "label": "2", "metadata": {"example_id": 1}}
    assert [d.name for d in cfg.eval.datasets] == ["vf"]  # the environment's eval split, 2 rows
    assert len(Path(cfg.eval.datasets[0].path).read_text().splitlines()) == 2
    source = [[Sample(prompt_index=k, sample_index=j, prompt=r["prompt"], label=r["label"], metadata=r["metadata"],
                      prompt_ids=[]) for j in range(N)] for k, r in enumerate(rows[:2])]
    samples, _ = run(engine, tokenizer, cfg, source, max_new_tokens=12)
    for s in samples:
        text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
        assert s.reward == float(s.label in text)  # the rubric's score of what the engine sampled
        assert s.metrics["rubric/reply_length"] == float(len(text)) and s.metrics["env_turns"] == 1.0
        assert tokenizer.decode(s.prompt_ids) == f"user: {s.prompt[0]['content']}<eos>assistant: "


def test_a_multi_turn_verifiers_environment_is_recorded_turn_by_turn(engine, tokenizer, long_model, addition_data,
                                                                     tmp_path):
    cfg = vf_config(long_model, addition_data, tmp_path, env_args={"multi_turn": True})
    source = [[Sample(prompt_index=0, sample_index=j, prompt=[{"role": "user", "content": "3+1="}], label="4",
                      metadata={"example_id": 3}, prompt_ids=[]) for j in range(N)]]
    samples, _ = run(engine, tokenizer, cfg, source, max_new_tokens=60)
    for s in samples:
        assert s.metrics["env_turns"] == 2.0 and s.metrics["chat_turns"] == 2.0
        inserted = tokenizer.decode([t for t, m in zip(s.response_ids, s.loss_mask or []) if m == 0])
        assert "user: again?<eos>assistant: " in inserted  # the environment's message, not trained on
        assert s.metrics["turns_not_extending"] == 0.0
