"""Host-side multi-turn text environments (no accelerator, no jax).

Environments are built by name (`make_env('alfworld' | 'textworld' | 'toy' | 'webshop',
**kwargs)`) so that worker processes can construct them from a picklable spec; heavy engines
import lazily.
"""

from envs.base import EnvStep, Task, TextEnv
from envs.pool import EnvPool, PoolStep
from envs.registry import make_env, task_list

__all__ = ["EnvPool", "EnvStep", "PoolStep", "Task", "TextEnv", "make_env", "task_list"]
