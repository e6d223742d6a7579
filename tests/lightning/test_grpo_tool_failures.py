"""GRPOModule steps whose environments cannot start some rollouts: those rows fail, are
counted in ``tools/failed_rollouts`` and warned about once, and the step goes on."""

import pytest

from lightning_logra.modules import MultiTurnConfig, RolloutConfig
from tests.helpers.grpo import fit_grpo, grpo_module
from tests.helpers.tools import ScriptedGeneration, TroubledEnvironment

GUESS = '<tool_call>{"name": "guess", "arguments": {"number": 7}}</tool_call>'


def environment_step(folder, factory, caught, max_positions=None):
    """One step with ``factory``'s environments, each rollout guessing then answering; the
    logged metrics. ``caught`` collects the fit's warnings."""
    grpo = grpo_module(folder, environment_factory=factory, multi_turn=MultiTurnConfig(max_turns=2),
                       rollout=RolloutConfig(num_generations=2, max_new_tokens=600, val_generations=2))
    assert grpo.multi_turn.max_positions == grpo.model_config.max_position_embeddings
    if max_positions is not None:
        grpo.multi_turn.max_positions = max_positions
    grpo.configure_model()
    ScriptedGeneration(grpo.policy, grpo.tokenizer, [GUESS, "done"])
    _, [logged] = fit_grpo(grpo, folder, steps=1, caught_warnings=caught)
    return logged


def test_a_reset_that_fails_fails_its_rollout_only(model_folder):
    made, caught = [], []

    def factory():  # the first instance made serves the first row; its reset raises
        made.append(TroubledEnvironment("raise" if not made else None))
        return made[-1]

    logged = environment_step(model_folder, factory, caught)
    assert logged["tools/failed_rollouts"] == 1.0
    assert logged["reward/failures"] == 1.0  # the environment's score of the failed rollout
    assert logged["turns/mean"] == 1.5 and logged["tools/calls_per_sample"] == 0.75
    assert [str(w.message) for w in caught if "could not start" in str(w.message)] == [
        "A rollout could not start: TroubledEnvironment.reset raised ValueError: cannot set up "
        f"{made[1].target}. Nothing is generated for it, its environment's score counts as failed and it counts in "
        "tools/failed_rollouts; later failures of this kind are only counted"]


def test_a_run_where_no_rollout_starts_stops_naming_the_cause(model_folder):
    # Every prompt, with the tools and the observation, is longer than 700 - 600 tokens.
    with pytest.raises(RuntimeError, match=r"8 updates in a row had no completion token to train on: .* no rollout "
                                           r"may have started \(tools/failed_rollouts"):
        environment_step(model_folder, TroubledEnvironment, [], max_positions=700)
