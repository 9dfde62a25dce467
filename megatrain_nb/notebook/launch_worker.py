"""One worker process of ``mt.Session(..., nproc_per_node=N)``, started by torchrun's elastic
agent (``python -m torch.distributed.run ... -m megatrain_nb.notebook.launch_worker RUN_DIR``).

It builds an ``mt.Trainer`` (an ``mt.SFTTrainer`` for an SFTConfig) from ``RUN_DIR/spec.json``
(``launch_spec.py``), gives it the spec's branch (a fork from a snapshot) and calls ``train()``: the same sharded path, process group from the environment and step-boundary
commands (``trainer/control.py``) as a script run under torchrun. At the end it saves the model
into ``output_dir`` (the weights live only in these processes) and writes ``rank-<r>.json``
(outcome, steps, the commands it applied). A rank that raises writes ``error-<r>.json`` (its
exception and traceback) first and re-raises, so the agent stops the others and the controller
can name the rank. Every file is plain JSON; nothing is unpickled.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

from megatrain_nb.channel.protocol import atomic_write_json
from megatrain_nb.processes import pid_alive
from megatrain_nb.threads import CONTROLLER_WATCH, thread_name

from .launch_spec import branch_start, build_from_spec
from .rank_watch import pid_file

ENV_CONTROLLER_PID = "MEGATRAIN_NB_CONTROLLER_PID"


def main(run_dir: str) -> None:
    run = Path(run_dir)
    rank = int(os.environ.get("RANK", "0"))
    # the controller watches this pid: a rank that dies without a word is then named
    atomic_write_json(pid_file(run, rank), {"rank": rank, "pid": os.getpid(), "time": time.time()})
    try:
        (trainer, _tokenizer), spec = build_from_spec(run)
        if rank == 0:
            _watch_controller(trainer)
        trainer.start_branch(branch_start(spec))   # a fork: every rank from the snapshot, as that branch
        trainer.train(resume_from_checkpoint=spec["resume"])
        control = trainer.run_control
        outcome = "stopped" if control is not None and control.stopped else "finished"
        model_dir = trainer.save_model() if spec.get("save_model", True) else None
        atomic_write_json(run / f"rank-{rank}.json", {
            "rank": rank, "pid": os.getpid(), "outcome": outcome, "step": trainer.state.global_step,
            "run_id": trainer.run_id, "model_dir": model_dir, "time": time.time(),
            "events": control.applied if control is not None else []})
        trainer.close()
    except BaseException as e:
        atomic_write_json(run / f"error-{rank}.json", {
            "rank": rank, "pid": os.getpid(), "type": type(e).__name__, "message": str(e)[:4000],
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-20000:],
            "time": time.time()})
        raise


def _watch_controller(trainer) -> None:
    """Rank 0: if the notebook kernel that launched us dies, stop the run at the next step
    rather than train on, unseen and unsteerable."""
    try:
        pid = int(os.environ.get(ENV_CONTROLLER_PID, ""))
    except ValueError:
        return

    def watch():
        while pid_alive(pid):
            time.sleep(2.0)
        control = trainer.run_control
        if control is not None and not control.stopped:
            control.command("stop", source="controller-exit")

    threading.Thread(target=watch, name=thread_name(CONTROLLER_WATCH), daemon=True).start()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m megatrain_nb.notebook.launch_worker RUN_DIR")
    main(sys.argv[1])
