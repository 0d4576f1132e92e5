"""Malformed actions for the admissible-command envs (TextWorld, WebShop): the hypothesis strategy
and the check their fuzz tests share."""

from hypothesis import strategies as st

from envs.base import AdmissibleCommandEnv, Task


def junk_actions(*extra):
  """Random text and bytes, very long strings, and `extra` near-misses of real commands."""
  return st.one_of(st.text(max_size=60), st.binary(max_size=40),
                   st.text(min_size=600, max_size=2000),
                   st.sampled_from(["", "x" * 10_000, None, 3.5, *extra]))


def check_junk_step(env: AdmissibleCommandEnv, task: Task, junk, is_real, invalid_observation):
  """Steps `env` (on `task`, restarted when over) with `junk`: a valid step must be a real command
  (`is_real(junk, admissible)`); an invalid one answers `invalid_observation()` (taken before the
  step) with reward 0, goes on and leaves the admissible list as it was."""
  saved, env.max_steps = env.max_steps, 10**9
  try:
    if env.task != task or env._done:  # pylint: disable=protected-access
      env.reset(task)
    adm = env._admissible.commands  # pylint: disable=protected-access
    expected = invalid_observation()
    step = env.step(junk)
    if step.valid:  # hypothesis can hit a real command
      assert is_real(junk, adm)
    else:
      assert step.observation == expected and step.reward == 0.0 and not step.done
      assert step.admissible_actions == adm
  finally:
    env.max_steps = saved
