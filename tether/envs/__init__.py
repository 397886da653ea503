"""Environments from other libraries as tether rollouts: TRL's environment classes, skyrl-gym's text
environments (tether/envs/trl.py, skyrl.py), chosen by ``rollout.environment`` (tether/envs/config.py)
and run by one episode loop (tether/envs/episode.py) with the engine's exact tokens."""
