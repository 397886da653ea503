"""rollout.environment: an environment from another library that generates each sample, keyed on its
``type`` (docs/environments.md). Imports no torch and none of those libraries."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from tether.config.base import Section


class TrlEnvironmentConfig(Section):
    """A TRL environment class (GRPOTrainer's environment_factory): one instance per sample,
    ``reset(**row)``, its public methods as the model's tools, ``get_reward()`` when it has one."""

    type: Literal["trl"] = "trl"
    """TRL's environment classes (tether/envs/trl.py)."""
    factory: str | dict[str, str]
    """The class (or function) making an environment: module:Name or file.py:Name. A mapping of names to
    such specs picks one per row by the row's ``environment`` field (TRL's dict form)."""
    max_turns: int | None = Field(None, ge=1)
    """Assistant turns per episode (TRL's max_tool_calling_iterations + 1). None: until a turn calls no
    tool or the response budget is spent."""
    max_turn_tokens: int | None = Field(None, ge=1)
    """Tokens one assistant turn may generate at most (rollout.max_response_len bounds the whole
    episode, inserted messages included). None: the whole budget left."""
    tool_parser: str = "hermes"
    """How tool calls are read from a turn: hermes (<tool_call>{json}</tool_call>), or module:fn."""
    chat_template: str | None = None
    """A chat template (Jinja text) instead of the tokenizer's."""


class SkyrlEnvironmentConfig(Section):
    """A skyrl-gym text environment (BaseTextEnv: init(prompt), step(action) -> observations, reward, done)."""

    type: Literal["skyrl_gym"] = "skyrl_gym"
    """skyrl-gym's environments (tether/envs/skyrl.py; pip install skyrl-gym)."""
    env_class: str | None = None
    """The registered environment (gsm8k, gsm8k_multi_turn, aime, lcb, ...; skyrl_gym.make's id).
    None: each row's ``env_class`` field names it, as in SkyRL's datasets."""
    env_config: dict[str, Any] = {}
    """The environment's env_config (its settings; SkyRL's skyrl_gym.<env_class> section)."""
    max_turns: int = Field(1, ge=1)
    """Assistant turns per episode at most (the environment may end it earlier); passed to the
    environment as extras["max_turns"] unless the row sets it."""
    max_turn_tokens: int | None = Field(None, ge=1)
    """Tokens one assistant turn may generate at most (rollout.max_response_len bounds the whole
    episode, observations included). None: the whole budget left."""
    reward: Literal["sum", "last"] = "sum"
    """The sample's reward from the steps' rewards: their sum, or the last step's."""
    chat_template: str | None = None
    """A chat template (Jinja text) instead of the tokenizer's."""


class GemEnvironmentConfig(Section):
    """A GEM environment (gem.make: reset(seed) -> (observation, info), step(action) -> (observation,
    reward, terminated, truncated, info))."""

    type: Literal["gem"] = "gem"
    """GEM's environments (tether/envs/gem.py; pip install --no-deps gem-llm)."""
    env_id: str | None = None
    """The registered environment (game:GuessTheNumber-v0-easy, rg:basic_arithmetic, ...; gem.make's id).
    None: each row's ``env_id`` field names it."""
    env_kwargs: dict[str, Any] = {}
    """Keyword arguments of gem.make (the environment's settings)."""
    append_suffix: bool = True
    """Show info["suffix"] after each observation (GEM's games put their prompt for the next move there)."""
    max_turns: int = Field(8, ge=1)
    """Assistant turns per episode at most."""
    max_turn_tokens: int | None = Field(None, ge=1)
    """Tokens one assistant turn may generate at most. None: the whole budget left."""
    reward: Literal["sum", "last"] = "sum"
    """The sample's reward from the steps' rewards: their sum, or the last step's."""
    chat_template: str | None = None
    """A chat template (Jinja text) instead of the tokenizer's."""


class OpenEnvConfig(Section):
    """An OpenEnv environment server (openenv-core's create_app), one WebSocket session per episode."""

    type: Literal["openenv"] = "openenv"
    """OpenEnv servers (tether/envs/openenv.py; the client needs only the websockets package)."""
    url: str | list[str]
    """The server (http://host:port), or several: samples spread over them."""
    action: str | None = None
    """A function from an assistant turn's text to the environment's action (a dict of its Action's
    fields): module:fn or file.py:fn. None: {action_key: text}."""
    action_key: str = "message"
    """The action field the turn's text goes to when there is no action function."""
    observation_key: str | None = None
    """The observation field shown to the model as the next user message. None: the whole observation,
    as JSON."""
    observation_separator: str = "\n"
    """Between the prompt and the first observation (appended to the last prompt message)."""
    max_turns: int = Field(8, ge=1)
    """Assistant turns per episode at most."""
    max_turn_tokens: int | None = Field(None, ge=1)
    """Tokens one assistant turn may generate at most. None: the whole budget left."""
    reward: Literal["sum", "last"] = "sum"
    """The sample's reward from the steps' rewards: their sum, or the last step's."""
    connect_timeout_s: float = Field(30.0, gt=0)
    """How long a refused connection is retried before the sample fails (kind environment)."""
    message_timeout_s: float = Field(60.0, gt=0)
    """The longest wait for the answer to one reset or step."""
    chat_template: str | None = None
    """A chat template (Jinja text) instead of the tokenizer's."""


class VerifiersConfig(Section):
    """A verifiers environment (vf.load_environment: its dataset, rollout logic and rubric), played in the
    Python environment that has verifiers, against the sample's chat session."""

    type: Literal["verifiers"] = "verifiers"
    """verifiers' environments (tether/envs/verifiers.py)."""
    env_id: str
    """The environment's id, as vf.load_environment takes it (its module's name, "-" for "_")."""
    env_args: dict[str, Any] = {}
    """Keyword arguments of the environment's load_environment."""
    python: str | None = None
    """A Python that imports verifiers and the environment's module (verifiers brings dozens of packages
    of its own). None: this one."""
    cwd: str | None = None
    """The worker's working directory, also put on its PYTHONPATH (where an environment module that is
    not installed lives). None: the run's."""
    eval_name: str | None = None
    """Also evaluate on the environment's eval split, as the eval set of this name (written at start-up
    beside the training rows when data.path is not set)."""
    sampling_args: dict[str, Any] = {}
    """The environment's sampling arguments (its requests carry them): max_tokens bounds each turn;
    temperature and the like are the rollout's own, whatever they say."""
    tool_parser: str = "hermes"
    """How tool calls are read from a turn, for a ToolEnv: hermes, or module:fn."""
    chat_template: str | None = None
    """A chat template (Jinja text) instead of the tokenizer's."""
    timeout_s: float = Field(600.0, gt=0)
    """The longest a rollout (or the dataset) may take in the worker."""


Environment = Annotated[Union[TrlEnvironmentConfig, SkyrlEnvironmentConfig, GemEnvironmentConfig, OpenEnvConfig,
                              VerifiersConfig], Field(discriminator="type")]

GENERATE_FN = {"trl": "tether.envs.trl:generate", "skyrl_gym": "tether.envs.skyrl:generate",
               "gem": "tether.envs.gem:generate", "openenv": "tether.envs.openenv:generate",
               "verifiers": "tether.envs.verifiers:generate"}
"""The generate function of each environment type."""
