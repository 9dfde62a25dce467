"""A fork's changes checked by the kind of run it forks: a GRPO run's ``beta`` by GRPO's rule
(0 allowed: no reference), a DPO run's by DPO's (> 0), ``temperature`` only in a GRPO run; the
same where the run's ranks train in worker processes and the kernel holds no trainer (the kind
then comes from ``remote.ProcessRun.training_kind``)."""
import pytest

from megatrain_nb.notebook.branches import check_changes


class _Grpo:   # what branch_grpo.is_grpo_trainer recognises
    reward_func_names = ["reward"]

    def fork_trainer(self):
        raise AssertionError("not built here")


@pytest.mark.parametrize("trainer, kind", [(_Grpo(), None), (None, "grpo")])
def test_a_grpo_fork_may_turn_the_kl_off(trainer, kind):
    assert check_changes({"beta": 0.0, "temperature": "0.7"}, trainer, kind) == {"beta": 0.0, "temperature": 0.7}
    with pytest.raises(ValueError, match=r"fork\(beta\)=-1(\.0)?: must be a finite number >= 0"):
        check_changes({"beta": -1.0}, trainer, kind)
    with pytest.raises(ValueError, match=r"fork\(temperature\)=0(\.0)?: must be a finite number > 0"):
        check_changes({"temperature": 0}, trainer, kind)


def test_ranks_in_worker_processes_are_checked_by_what_they_train():
    with pytest.raises(ValueError, match=r"fork\(beta\)=0(\.0)?: must be a finite number > 0"):
        check_changes({"beta": 0.0}, None, "dpo")
    assert check_changes({"beta": 0.2, "loss_type": "sigmoid"}, None, "dpo") == {"beta": 0.2, "loss_type": ["sigmoid"]}
    with pytest.raises(ValueError, match="temperature only in a GRPO run; a dpo run samples no completions"):
        check_changes({"temperature": 0.5}, None, "dpo")
    for k, v in (("beta", 0.1), ("loss_type", "sigmoid")):
        with pytest.raises(ValueError, match=f"{k} only in a preference \\(DPO\\) run; its ranks train a plain run"):
            check_changes({k: v}, None, "plain")
    with pytest.raises(ValueError, match="temperature only in a GRPO run; a sft run"):
        check_changes({"temperature": 0.5}, None, "sft")
    assert check_changes({"learning_rate": "1e-3"}, None, "plain") == {"learning_rate": 1e-3}
