"""Environments from other libraries as tether rollouts: TRL's environment classes, skyrl-gym's text
environments, GEM environments, OpenEnv servers, verifiers environments (tether/envs/trl.py,
skyrl.py, gem.py, openenv.py, verifiers.py), chosen by ``rollout.environment`` (tether/envs/config.py)
and run by one episode loop (tether/envs/episode.py) with the engine's exact tokens."""
