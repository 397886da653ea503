"""The bad-input corpus: malformed configs, dataset rows, HTTP requests and user functions, each tried
against a run directory that holds an earlier run's checkpoint and logs.

Every case asserts the same four things: the input is refused with an error that names what is wrong
(the config field, the file and line, the request field, or the function and the sample), within a
bounded time (nothing hangs), and the earlier run's checkpoint and logs are byte for byte as they were
(an engine server still serves, for the HTTP cases). The README counts them.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import tiny_config
from tether.cli import main
from tether.config import config_from_dict
from tether.train import train

pytestmark = pytest.mark.integration
FUNCTIONS = Path(__file__).parent / "corpus_functions.py"
FN = f"{FUNCTIONS}:"


# ---------------------------------------------------------------- the earlier run every case is tried against
@pytest.fixture(scope="module")
def earlier_run(ray_session, tiny_model_dir, addition_data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("earlier_run")
    raw = tiny_config(tiny_model_dir, addition_data, out, rollout={"num_rollout": 1}, checkpoint={"save_interval": 1},
                      eval={"datasets": []})
    train(config_from_dict(raw))
    return {"out": out, "raw": raw}


def snapshot(out: Path) -> dict[str, str]:
    """sha256 of every file of the run's checkpoints, metrics and trained-sample log."""
    files = [p for p in sorted(out.rglob("*")) if p.is_file()
             and (p.relative_to(out).parts[0] == "checkpoints" or p.name in ("metrics.jsonl", "trained_samples.jsonl"))]
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def refused_by_cli(earlier_run, tmp_path, capsys, raw_or_text, expect: str, limit_s: float = 30) -> None:
    """``tether train`` on this config: exit 2, the expected error, in bounded time, nothing touched."""
    before = snapshot(earlier_run["out"])
    path = tmp_path / "run.yaml"
    path.write_text(raw_or_text if isinstance(raw_or_text, str) else yaml.safe_dump(raw_or_text))
    start = time.monotonic()
    code = main(["train", "--config", str(path)])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert re.search(expect, err), err[-2000:]
    assert elapsed < limit_s
    assert snapshot(earlier_run["out"]) == before


def base(earlier_run, **sections) -> dict:
    raw = json.loads(json.dumps(earlier_run["raw"]))
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values) if isinstance(values, dict) else raw.__setitem__(section, values)
    return raw


# ---------------------------------------------------------------- configs
CONFIGS = {
    "unknown-section": ({"rolout": {"num_rollout": 2}}, r"rolout"),
    "unknown-field": ({"rollout": {"temprature": 0.7}}, r"rollout\.temprature"),
    "wrong-type": ({"rollout": {"temperature": "hot"}}, r"rollout\.temperature"),
    "negative-lr": ({"train": {"lr": -1.0}}, r"train\.lr"),
    "zero-samples": ({"rollout": {"n_samples_per_prompt": 0}}, r"rollout\.n_samples_per_prompt"),
    "micro-above-global": ({"train": {"micro_batch_size": 64, "global_batch_size": 8}}, r"micro_batch_size"),
    "unknown-loss": ({"algorithm": {"policy_loss": "ppo_clipped"}}, r"algorithm\.policy_loss"),
    "unknown-estimator": ({"algorithm": {"advantage_estimator": "grpo2"}}, r"algorithm\.advantage_estimator"),
    "unknown-engine": ({"engine": {"backend": "tensorrt"}}, r"engine"),
    "reward-file-missing": ({"rollout": {"reward": "/nonexistent/reward.py:score"}}, r"rollout\.reward"),
    "reward-fn-missing": ({"rollout": {"reward": FN + "no_such_reward"}}, r"rollout\.reward.*no_such_reward"),
    "filter-fn-missing": ({"rollout": {"dynamic_filter": FN + "no_such_filter"}}, r"rollout\.dynamic_filter"),
    "generate-fn-missing": ({"rollout": {"custom_generate_fn": FN + "nope"}}, r"rollout\.custom_generate_fn"),
    "loss-fn-missing": ({"algorithm": {"policy_loss": FN + "no_such_loss"}}, r"algorithm\.policy_loss"),
    "model-path-missing": ({"model": {"path": "/nonexistent/model"}}, r"model\.path"),
    "data-path-missing": ({"data": {"path": "/nonexistent/train.jsonl"}}, r"data\.path"),
    "public-host-without-key": ({"engine": {"host": "0.0.0.0"}}, r"cluster\.api_key"),
    "zero-train-actors": ({"cluster": {"num_train_actors": 0}}, r"cluster\.num_train_actors"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_config(earlier_run, tmp_path, capsys, case):
    sections, expect = CONFIGS[case]
    refused_by_cli(earlier_run, tmp_path, capsys, base(earlier_run, **sections), expect)


YAML_TEXTS = {
    "duplicate-key": ("seed: 1\nseed: 2\n", r"run\.yaml.*line 2.*seed|seed.*run\.yaml.*line 2|duplicate"),
    "syntax-error": ("seed: 1\nrollout: {num_rollout: 2\n", r"run\.yaml:3:1: not valid YAML: expected ',' or '}'"),
    "not-a-mapping": ("- just\n- a list\n", r"run\.yaml"),
}


@pytest.mark.parametrize("case", list(YAML_TEXTS))
def test_yaml_text(earlier_run, tmp_path, capsys, case):
    text, expect = YAML_TEXTS[case]
    good = yaml.safe_dump(earlier_run["raw"])
    refused_by_cli(earlier_run, tmp_path, capsys, good + text if case == "duplicate-key" else text, expect)


# ---------------------------------------------------------------- dataset rows (line 3 of the file is the bad one)
GOOD_ROW = {"prompt": "1+2=", "label": "3"}
ROWS = {
    "empty-prompt": ({"prompt": "", "label": "1"}, "the prompt is empty"),
    "prompt-past-positions": ({"prompt": "9" * 70, "label": "1"}, "positions, the model has 64"),
    "list-label": ({"prompt": "1+2=", "label": ["3"]}, "field 'label' is a list"),
    "dict-label": ({"prompt": "1+2=", "label": {"a": 3}}, "field 'label' is a dict"),
    "missing-prompt": ({"question": "1+2="}, "missing prompt key 'prompt'"),
    "number-prompt": ({"prompt": 12, "label": "1"}, "must be a string or a list of chat messages"),
    "null-prompt": ({"prompt": None, "label": "1"}, "prompt"),
    "metadata-not-object": ({"prompt": "1+2=", "label": "3", "metadata": [1]}, "field 'metadata' must be a JSON object"),
    "invalid-json": (b'{"prompt": "1+2=", ', "invalid JSON"),
    "json-list": (b"[1, 2]", "expected a JSON object, got list"),
    "not-utf8": (b'{"prompt": "\xff\xfe"}', "not UTF-8 text"),
}


def rows_file(path: Path, bad) -> Path:
    lines = [json.dumps(GOOD_ROW).encode()] * 2 + [bad if isinstance(bad, bytes) else json.dumps(bad).encode()]
    path.write_bytes(b"\n".join(lines + [json.dumps(GOOD_ROW).encode()] * 8) + b"\n")
    return path


@pytest.mark.parametrize("case", list(ROWS))
def test_dataset_row(earlier_run, tmp_path, capsys, case):
    bad, expect = ROWS[case]
    data = rows_file(tmp_path / "train.jsonl", bad)
    raw = base(earlier_run, data={"path": str(data)}, rollout={"reward": "exact_match"})
    refused_by_cli(earlier_run, tmp_path, capsys, raw, re.escape(f"{data}:3") + ".*" + re.escape(expect))


def test_eval_dataset_row(earlier_run, tmp_path, capsys):
    data = rows_file(tmp_path / "eval.jsonl", {"prompt": ""})
    raw = base(earlier_run, eval={"datasets": [{"name": "add", "path": str(data), "max_response_len": 4}]})
    refused_by_cli(earlier_run, tmp_path, capsys, raw, re.escape(f"{data}:3") + ".*the prompt is empty")


# ---------------------------------------------------------------- HTTP requests to an engine server
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from tether.engine.core import EngineCore
    from tether.engine.embedded import EmbeddedEngine
    from tether.engine.server import EngineServer
    from tether.models.hf import load_tokenizer
    from tether.http.guard import ServerLimits

    core = EngineCore(EmbeddedEngine(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir)), max_batch=8)
    server = EngineServer(core, limits=ServerLimits(max_body_bytes=1 << 16)).start()
    yield server
    server.stop()


OK = {"max_new_tokens": 2, "temperature": 0.0}
REQUESTS = {
    "nan-temperature": ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"temperature": NaN}}', 422, "temperature"),
    "inf-top-p": ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"top_p": Infinity}}', 422, "top_p"),
    "negative-max-new": ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -3}}, 422,
                         "max_new_tokens"),
    "max-new-past-positions": ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 500}}, 400,
                               "positions"),
    "huge-top-k": ("/generate", {"input_ids": [5, 6], "sampling_params": {**OK, "top_k": 10**9}}, 400, "top_k"),
    "stop-id-outside-vocab": ("/generate", {"input_ids": [5, 6], "sampling_params": {**OK, "stop_token_ids": [10**6]}},
                              400, "stop_token_ids"),
    "token-outside-vocab": ("/generate", {"input_ids": [5, 10**6], "sampling_params": OK}, 400, "input_ids"),
    "string-tokens": ("/generate", {"input_ids": ["a", "b"], "sampling_params": OK}, 422, "input_ids"),
    "no-prompt": ("/generate", {"sampling_params": OK}, 422, "input_ids"),
    "params-count-mismatch": ("/generate", {"input_ids": [[5], [6]], "sampling_params": [OK, OK, OK]}, 400,
                              "sampling_params"),
    "not-json": ("/generate", b"{input_ids: [5", 422, "json"),
    "body-too-large": ("/generate", {"input_ids": [5] * 40000, "sampling_params": OK}, 413, "bytes"),
    "chat-without-messages": ("/v1/chat/completions", {"model": "m"}, 422, "messages"),
    "chat-bad-temperature": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "temperature": -1}, 422, "temperature"),
}


@pytest.mark.parametrize("case", list(REQUESTS))
def test_http_request(engine, case):
    path, body, status, field = REQUESTS[case]
    with httpx.Client(base_url=engine.url, timeout=30) as client:
        start = time.monotonic()
        kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        reply = client.post(path, **kwargs)
        assert time.monotonic() - start < 10
        assert reply.status_code == status, reply.text
        assert field in reply.text.lower() if field == "json" else field in reply.text, reply.text
        # The server still serves: nothing of it was lost to the bad request.
        ok = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": OK})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


# ---------------------------------------------------------------- user functions, called where a run calls them
@pytest.fixture(scope="module")
def shared_engine(earlier_run):
    """One engine for every function case (a rollout manager with the case's config drives it)."""
    from tether.cluster import plan_placement
    from tether.rollout.handle import create_engines

    cfg = config_from_dict(earlier_run["raw"])
    placement = plan_placement(cfg.cluster)
    engines = create_engines(cfg, placement)
    yield engines
    import ray

    for engine in engines:
        ray.kill(engine)
    placement.remove()


SAMPLE = r"prompt_index=\d+"
FUNCTION_CASES = {
    "reward-raises": ({"reward": FN + "reward_raises"}, r"reward_raises' raised ZeroDivisionError.*" + SAMPLE),
    "reward-nan": ({"reward": FN + "reward_nan"}, r"reward_nan' returned nan.*" + SAMPLE),
    "reward-none": ({"reward": FN + "reward_none"}, r"reward_none' returned None.*" + SAMPLE),
    "reward-string": ({"reward": FN + "reward_text"}, r"reward_text' returned 'correct'.*" + SAMPLE),
    "reward-hangs": ({"reward": FN + "reward_hangs", "reward_timeout_s": 2}, r"reward_hangs.*2s.*" + SAMPLE),
    "reward-dict-without-key": ({"reward": FN + "reward_dict_without_key", "reward_key": "score"},
                                r"reward_dict_without_key.*'score'.*" + SAMPLE),
    "group-reward-wrong-length": ({"group_reward": FN + "group_reward_short"},
                                  r"rollout\.group_reward '.*group_reward_short' returned .* for a group of 4"),
    "group-reward-raises": ({"group_reward": FN + "group_reward_raises"},
                            r"rollout\.group_reward '.*group_reward_raises' raised ValueError: judge unavailable"),
    "filter-raises": ({"dynamic_filter": FN + "filter_raises"}, r"filter_raises' raised KeyError.*" + SAMPLE),
    "filter-string": ({"dynamic_filter": FN + "filter_text"}, r"filter_text' returned 'yes'.*" + SAMPLE),
    "filter-none": ({"dynamic_filter": FN + "filter_none"}, r"filter_none' returned None.*" + SAMPLE),
    "generate-none": ({"custom_generate_fn": FN + "generate_none"}, r"generate_none' returned None.*" + SAMPLE),
    "generate-raises": ({"custom_generate_fn": FN + "generate_raises"},
                        r"generate_raises' raised RuntimeError: tool server refused.*" + SAMPLE),
    "generate-string": ({"custom_generate_fn": FN + "generate_text"}, r"generate_text' returned '.*" + SAMPLE),
    "generate-misaligned": ({"custom_generate_fn": FN + "generate_misaligned"},
                            r"generate_misaligned' returned a sample that cannot be trained on.*log"),
    "generate-empty-list": ({"custom_generate_fn": FN + "generate_empty_list"},
                            r"generate_empty_list' returned \[\].*" + SAMPLE),
}


@pytest.mark.parametrize("case", list(FUNCTION_CASES))
def test_user_function(earlier_run, shared_engine, case):
    import ray

    from tether.rollout.handle import RolloutHandle

    rollout_section, expect = FUNCTION_CASES[case]
    before = snapshot(earlier_run["out"])
    cfg = config_from_dict(base(earlier_run, rollout=rollout_section))
    handle = RolloutHandle(cfg, shared_engine)
    try:
        start = time.monotonic()
        with pytest.raises(Exception) as err:
            handle.generate(1)
        assert time.monotonic() - start < 30
    finally:
        ray.kill(handle.actor)
    assert re.search(expect, str(err.value), flags=re.S), str(err.value)[-3000:]
    assert snapshot(earlier_run["out"]) == before


LOSS_CASES = {
    "loss-nan": ("loss_nan", r"rollout 1, optimizer step 1/\d: non-finite step .*nothing was saved or pushed"),
    "loss-none": ("loss_none", r"algorithm\.policy_loss '.*loss_none' returned None"),
    "loss-wrong-shape": ("loss_vector", r"algorithm\.policy_loss '.*loss_vector' returned a loss of shape \(3,\)"),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_user_loss(earlier_run, tmp_path, case):
    fn, expect = LOSS_CASES[case]
    out = earlier_run["out"]
    before, metrics = snapshot(out), (out / "metrics.jsonl").read_text()
    raw = base(earlier_run, algorithm={"policy_loss": FN + fn}, rollout={"num_rollout": 2},
               checkpoint={"load": str(out / "checkpoints"), "save_interval": 1,
                           "allow_config_change": ["algorithm.policy_loss"]})
    start = time.monotonic()
    with pytest.raises(Exception) as err:
        train(config_from_dict(raw))
    assert time.monotonic() - start < 90
    assert re.search(expect, str(err.value), flags=re.S), str(err.value)[-3000:]
    # The checkpoint is as it was; the metrics log still holds every earlier line.
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k.startswith("checkpoints")} == \
        {k: v for k, v in before.items() if k.startswith("checkpoints")}
    assert (out / "metrics.jsonl").read_text().startswith(metrics)
