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


Environment = Annotated[Union[TrlEnvironmentConfig, SkyrlEnvironmentConfig], Field(discriminator="type")]

GENERATE_FN = {"trl": "tether.envs.trl:generate", "skyrl_gym": "tether.envs.skyrl:generate"}
"""The generate function of each environment type."""
