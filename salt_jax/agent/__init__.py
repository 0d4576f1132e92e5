"""The agent side of the loop: prompts per step, action parsing and the demonstrations' stand-in
reasoning (`reasoning`; host side, no jax)."""

from salt_jax.agent.parsing import ParsedAction, normalize_action, parse_action
from salt_jax.agent.prompts import (CHATML_TEMPLATE, Conversation, PromptConfig, Prompter,
                                    toy_chat_tokenizer)

__all__ = [
    "CHATML_TEMPLATE",
    "Conversation",
    "ParsedAction",
    "PromptConfig",
    "Prompter",
    "normalize_action",
    "parse_action",
    "toy_chat_tokenizer",
]
