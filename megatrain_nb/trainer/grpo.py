"""``mt.GRPOTrainer``: a drop-in for ``trl.GRPOTrainer`` (trl 1.x) on the streaming engine.

Example::

    import megatrain_nb as mt
    from trl import GRPOConfig

    def reward_len(completions, **kw):
        return [-abs(20 - len(c)) for c in completions]

    trainer = mt.GRPOTrainer(model="path/to/model", reward_funcs=reward_len, train_dataset=prompts,
                             args=GRPOConfig(output_dir="out", bf16=False), max_vram_gb=40)
    trainer.train()

Rollouts (:mod:`.grpo_data`, :mod:`.grpo_rollout`): the prompts in TRL's order and TRL's order of
random draws, completions sampled by transformers' ``generate`` on a resident copy of the current
weights in the compute dtype (bf16 under ``precision="bf16"``; the model fits) or by the engine's
layer-major streamed decoder (it does not, or ``generation="streamed"``:
:func:`.grpo_rollout.make_policy`), rewards and advantages by TRL's
formulas; old log-probs (when a generation serves several optimizer steps) and the reference's
(``beta > 0``: a frozen engine of the starting weights) by forward-only streamed passes. The loss is a sequence-level objective of
the engine's chunked head (:mod:`.grpo_loss`). The loop is :class:`~.trainer.Trainer`'s: the
rollouts come in through its public ``fresh_stream`` (a stream of rollout micro-batches).
GRPOConfig fields that cannot apply here are refused by name. Under torchrun each rank generates,
scores and takes the log-probs of its slice of the generation batch, gathered, each rollout
sampling from its own random stream (``rollout_seeds="per_rollout"``): the run is the same for any
number of ranks at the same global batch (:mod:`.grpo_ranks`).
"""
from __future__ import annotations

import copy
import math
import os
import time
from collections import defaultdict

import torch

from megatrain_nb.engine import StreamingEngine
from megatrain_nb.engine.compute.decode import share_device

from .kinds import MetricLists, register_kind
from .grpo_eval import run_evaluation
from .grpo_data import RolloutStream, longest_prompt_tokens, pad_rollouts, tokenize_prompts
from .grpo_loss import GRPOObjective, GRPOSettings
from .grpo_ranks import (check_rollout_seeds, gather_lists, gather_rewards, gather_rows, lockstep, rank_rows,
                         row_generators, sampling_base, seeded_shuffle)
from .grpo_rollout import (advantages, check_generation, completion_logps, eos_token_ids, generation_config,
                           generation_words, length_metrics, make_policy, reward_metrics, score)
from .args import check_eval_plan
from .grpo_fields import validate_grpo_args
from .sft_data import require_trl
from .trainer import Trainer, local_tokenizer

def coerce_grpo_args(args):
    """``args`` as a ``trl.GRPOConfig`` (None: TRL's defaults; a dict of its fields)."""
    require_trl()
    from trl import GRPOConfig

    if args is None:
        return GRPOConfig(output_dir="megatrain_outputs", bf16=False)
    if isinstance(args, dict):
        return GRPOConfig(**{"output_dir": "megatrain_outputs", "bf16": False, **args})
    if isinstance(args, GRPOConfig):
        return args
    raise TypeError(f"args must be a trl.GRPOConfig (or a dict of its fields), got {type(args).__name__}")


def _refuse(peft_config, quantization_config, optimizers, tools, rollout_func, environment_factory, processing_class):
    from transformers import ProcessorMixin

    given = {"peft_config": "PEFT adapters: megatrain_nb trains every weight in full precision (drop peft_config; "
                            "for adapters use trl.GRPOTrainer)",
             "quantization_config": "quantized models cannot be trained in full precision",
             "tools": "tool calling during rollouts is not supported yet",
             "rollout_func": "custom rollout functions are not supported yet",
             "environment_factory": "environments are not supported yet"}
    values = {"peft_config": peft_config, "quantization_config": quantization_config, "tools": tools,
              "rollout_func": rollout_func, "environment_factory": environment_factory}
    bad = [f"{k} ({given[k]})" for k, v in values.items() if v]
    if any(optimizers):
        bad.append("optimizers (the engine runs its own AdamW)")
    if isinstance(processing_class, ProcessorMixin):
        bad.append("a ProcessorMixin processing_class (vision-language models are not supported: train the text "
                   "model with a tokenizer, or use trl.GRPOTrainer)")
    if bad:
        raise ValueError("GRPOTrainer arguments not supported by megatrain_nb: " + "; ".join(bad))


def _reward_name(fn) -> str:
    if isinstance(fn, torch.nn.Module):
        return str(getattr(fn.config, "name_or_path", "") or type(fn).__name__).split("/")[-1]
    return getattr(fn, "__name__", type(fn).__name__)


def _reward_funcs(reward_funcs, reward_processing_classes, trust_remote_code):
    """(functions, names, processing classes) as TRL takes them; a string is a local reward model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if reward_funcs is None:
        raise ValueError("reward_funcs is required: a callable, a reward model, or a list of them")
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for i, f in enumerate(funcs):
        if isinstance(f, (str, os.PathLike)):
            if not os.path.isdir(f):
                raise ValueError(f"reward_funcs[{i}]={str(f)!r}: a reward model is a local folder here (nothing "
                                 "downloads at run time); pass a folder or a loaded model")
            funcs[i] = AutoModelForSequenceClassification.from_pretrained(str(f), num_labels=1,
                                                                          trust_remote_code=trust_remote_code)
        elif not (callable(f) or isinstance(f, torch.nn.Module)):
            raise TypeError(f"reward_funcs[{i}] is a {type(f).__name__}: give a callable or a reward model")
    procs = reward_processing_classes
    procs = [None] * len(funcs) if procs is None else (list(procs) if isinstance(procs, (list, tuple)) else [procs])
    if len(procs) != len(funcs):
        raise ValueError("The number of reward processing classes must match the number of reward functions.")
    for i, (f, p) in enumerate(zip(funcs, procs)):
        if isinstance(f, torch.nn.Module):
            if p is None:
                p = AutoTokenizer.from_pretrained(getattr(f.config, "name_or_path", None) or _reward_name(f))
            if p.pad_token_id is None:
                p.pad_token = p.eos_token
            f.config.pad_token_id = p.pad_token_id
            procs[i] = p
    return funcs, [_reward_name(f) for f in funcs], procs


def _model_eos(model):
    """The end-of-sequence id(s) of the model's generation config (a module's, or a folder's
    generation_config.json); None: the engine's model config says."""
    if isinstance(model, (str, os.PathLike)):
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(str(model)).eos_token_id
        except OSError:   # no generation_config.json
            return None
    return getattr(getattr(model, "generation_config", None), "eos_token_id", None)


def _reference_source(model, beta: float, ref_model):
    """The starting weights the reference is built from (a module's copy or a folder): kept when
    ``beta`` > 0, and a folder always (it costs nothing: a fork may raise beta); ``ref_model``
    (a module or folder of the starting weights) when ``model`` is an engine (a fork's)."""
    if ref_model is not None:
        return ref_model
    if isinstance(model, (str, os.PathLike)):
        return model
    if beta != 0.0 and not isinstance(model, torch.nn.Module):
        raise ValueError("beta > 0 needs the reference (the policy as it starts): give model= a module or a local "
                         "folder, not an engine (its starting weights cannot be read back), or ref_model= them")
    return copy.deepcopy(model) if beta != 0.0 else None


def _num(x):
    """A metric's value as JSON keeps it (None stays None)."""
    return None if x is None else float(x)


def _row_tokens(tok, dataset, args):
    """A rollout's tokens at most: the longest prompt the tokenizer makes of the dataset's first
    rows (:func:`.grpo_data.longest_prompt_tokens`) plus ``max_completion_length``; None (the
    Trainer's default row) when the prompts cannot be tokenised before the engine is built."""
    prompt = longest_prompt_tokens(tok, dataset, args.chat_template_kwargs)
    return None if prompt is None else prompt + args.max_completion_length


class BranchStream(RolloutStream):
    """A fork's rollouts (``Session.fork``): they go on from the snapshot's data position (the
    sampler's order replayed to its epoch), the generation batch there made anew with the fork's
    settings (the stored rollouts are not in a snapshot). At a generation boundary with the
    snapshot's random state, a fork that changes nothing of the sampling makes the parent's rollouts."""

    def load_state_dict(self, state: dict) -> None:
        self.replay(state)   # the sampler's order to the snapshot's position (RolloutStream.replay)
        self._step = int(state.get("step", self.consumed))   # (the buffer is not taken: made anew, a fork's settings)


class GRPOKind:
    """The GRPO kind of training (trainer/kinds.py's hooks): the step's loss is the objective's
    (its micro-batch losses summed, as TRL logs them); the step's record gets the seconds its
    rollouts took (``generation_s``; its training: ``step_time_s``), the latest rollouts' reward,
    reward std, each reward function's mean (``rewards/<name>/mean``) and mean completion length,
    and the step's mean KL to the reference (``kl``, beta != 0): what the dashboard's GRPO panel
    draws (notebook/grpo_view.py). The rollouts and the objective's data come in through the
    trainer's stream, :class:`.grpo_data.RolloutStream`."""

    name = "grpo"
    #: completions all masked (mask_truncated_completions, every one truncated): a zero-gradient step, as TRL's
    steps_without_targets = True

    def before_run(self, trainer) -> bool:
        return True

    def before_window(self, trainer, window: list) -> dict:
        # the step's time split: making its rollouts (0.0 when a stored generation serves it) vs
        # training (the record's step_time_s)
        return {"generation_s": getattr(trainer.data_stream, "generation_s", 0.0)}

    def step_loss(self, trainer, out, loss_sum: float, n_items: int) -> float:
        return float(trainer.dist.sum(out.objective_loss))

    def after_window(self, trainer, window: list, out, record: dict) -> None:
        # every rank's micro-batches' metrics, in the step's order (logged with the rollouts': GRPOTrainer.log)
        step = trainer.train_metrics.add(gather_lists(trainer.dist, out.objective_metrics or []))
        record.update(trainer.last_rollout)
        if step.get("kl") is not None:   # beta != 0: this step's mean KL to the reference
            record["kl"] = step["kl"]


register_kind("grpo", GRPOKind)


class GRPOTrainer(Trainer):
    """Online RL from rewards driven like ``trl.GRPOTrainer``, trained by the StreamingEngine.

    Same constructor as ``trl.GRPOTrainer`` (``model``, ``reward_funcs``, ``args``,
    ``train_dataset``, ``eval_dataset``, ``processing_class``, ``reward_processing_classes``,
    ``callbacks``) plus any EngineConfig field as a keyword, and ``generation=`` (``"auto"`` |
    ``"resident"`` | ``"streamed"``: where completions are sampled) and ``rollout_seeds=``
    (``"global"``: TRL's order of draws, one process's default | ``"per_rollout"``: each rollout's
    own stream, the rule under several ranks: :mod:`.grpo_ranks`).
    """

    _eval_set_later = True   # the eval prompts are kept after Trainer.__init__; the eval plan is checked before it

    def __init__(self, model=None, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None, *, tokenizer=None, loss_fn=None, seq_len=None, ref_model=None,
                 **engine_options):
        require_trl()
        processing_class = processing_class if processing_class is not None else tokenizer
        _refuse(peft_config, quantization_config, optimizers, tools, rollout_func, environment_factory,
                processing_class)
        if loss_fn is not None and not isinstance(loss_fn, GRPOObjective):
            raise ValueError("loss_fn does not apply to GRPOTrainer: GRPOConfig.loss_type picks the loss")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        if not hasattr(train_dataset, "__len__") or isinstance(train_dataset, torch.utils.data.IterableDataset):
            raise NotImplementedError("an iterable train_dataset is not supported by megatrain_nb's GRPOTrainer yet "
                                      "(TRL's RepeatSampler needs the prompts' count): give a datasets.Dataset or a list")
        if "prompt" not in (getattr(train_dataset, "column_names", None) or train_dataset[0]):
            raise ValueError("train_dataset needs a 'prompt' column (text, or a conversation: a list of messages)")
        args = coerce_grpo_args(args)
        validate_grpo_args(args)
        # where completions are sampled: "auto" (resident when it fits the device budget) | "resident" | "streamed"
        self.generation = check_generation(engine_options.pop("generation", "auto"))
        # how completions draw their random numbers: "global" (TRL's order, one process) | "per_rollout"
        rollout_seeds = engine_options.pop("rollout_seeds", None)
        check_eval_plan(args, eval_dataset)
        self.settings = GRPOSettings.from_args(args)
        self.objective = GRPOObjective(self.settings)
        self.num_iterations = args.num_iterations
        self.reward_funcs, self.reward_func_names, self.reward_processing_classes = _reward_funcs(
            reward_funcs, reward_processing_classes, args.trust_remote_code)
        weights = args.reward_weights
        if weights is not None and len(weights) != len(self.reward_funcs):
            raise ValueError(f"Number of reward weights ({len(weights)}) must match number of reward functions "
                             f"({len(self.reward_funcs)})")
        self.reward_weights = torch.tensor(weights if weights is not None else [1.0] * len(self.reward_funcs),
                                           dtype=torch.float32)
        if isinstance(model, torch.nn.Module) and args.disable_dropout:
            for m in model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
        # the reference (beta > 0): the policy as it starts, streamed through a frozen engine of its own
        self._ref_source = _reference_source(model, args.beta, ref_model)
        model_eos = _model_eos(model)
        if processing_class is None and isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
            processing_class = local_tokenizer(model)   # (the folder's: the prompts' length before the engine is built)
        # the rows a step trains on, which the engine's plan and the prediction are made for (the
        # base class keeps it: its train_dataset, None here, has no rows of its own)
        self._rows_seq = _row_tokens(processing_class, train_dataset, args)
        super().__init__(model=model, train_dataset=None, args=args, processing_class=processing_class,
                         callbacks=callbacks, loss_fn=self.objective, **engine_options)
        # several ranks (grpo_ranks.py): rollouts split and gathered, per-rollout random streams, streamed decoding
        self.rollout_seeds = check_rollout_seeds(rollout_seeds, self.dist.world, self.generation)
        if self.rollout_seeds == "per_rollout" and self.generation == "auto":
            self.generation = "streamed"
        self._check_rank_batch(args)
        self._sampling_base = None   # the latest generation's per-rollout base seed ("per_rollout")
        self.kind = GRPOKind()
        self.last_rollout: dict = {}   # the latest generation's reward, reward_std, completion length
        self._setup_generation(model_eos)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self._ref_engine = None
        self._policy = None
        self.generation_where = ""   # where the first generation batch's completions were sampled, and why
        self._metrics = defaultdict(list)
        self.eval_metrics = defaultdict(list)   # an evaluation's rollout metrics (grpo_eval.py)
        self.train_metrics = MetricLists(skip_nan=True)   # the objective's, from the engine's outputs
        self._rollout_tokens = 0
        from transformers.trainer_utils import set_seed

        set_seed(args.seed)   # as transformers' Trainer seeds once the models are built (TRL's order of draws)

    def _setup_generation(self, model_eos) -> None:
        tok = self.tokenizer
        if tok is None:
            raise ValueError("GRPOTrainer needs a tokenizer: pass processing_class=... (or a model folder that holds one)")
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        if model_eos is None:
            model_eos = getattr(self._engine.model_config, "eos_token_id", None)
        self.eos_token_ids = eos_token_ids(model_eos, tok)
        self.generation_config = generation_config(self.args, tok, self.eos_token_ids)

    def _check_rank_batch(self, args) -> None:
        """TRL's batch rule over the ranks: a generation batch is ``per_device_train_batch_size x
        steps_per_generation x ranks`` rollouts (GRPOConfig computes it with the world size it sees)."""
        W = self.dist.world
        want = args.per_device_train_batch_size * args.steps_per_generation * W
        if W > 1 and args.generation_batch_size != want:
            raise ValueError(f"GRPOConfig.generation_batch_size={args.generation_batch_size} on {W} ranks: it must be "
                             f"per_device_train_batch_size ({args.per_device_train_batch_size}) x steps_per_generation "
                             f"({args.steps_per_generation}) x ranks ({W}) = {want}; build the GRPOConfig in the "
                             "worker processes (it reads the world size), or set generation_batch_size to match")

    # ------------------------------------------------------------------ the loop's seams
    @property
    def total_steps(self) -> int:
        """Optimizer steps this run plans (``max_steps``, or epochs of TRL's repeated prompts)."""
        a = self.args
        if a.max_steps is not None and a.max_steps > 0:
            return int(a.max_steps)
        G, per_gen, spg = a.num_generations, a.generation_batch_size // a.num_generations, a.steps_per_generation
        spg *= self.dist.world   # micro-batches of a generation batch, over all ranks
        n = len(self.train_dataset) // per_gen * per_gen * G * self.num_iterations * spg
        micro = n // (a.per_device_train_batch_size * spg)
        return int(math.ceil(a.num_train_epochs * max(-(-micro // (a.gradient_accumulation_steps * self.dist.world)),
                                                     1)))

    def fresh_stream(self):
        """The rollouts' stream at a run's start (TRL's prompt order and draws)."""
        branch = self.branch_start is not None   # a fork: the stream goes on from the snapshot's position
        self._stream = (BranchStream if branch else RolloutStream)(self, self.train_dataset)
        return self._stream

    # ------------------------------------------------------------------ rollouts
    def _reference_engine(self):
        if self._ref_engine is None:
            src = self._ref_source
            self._ref_engine = (StreamingEngine(src, self._engine.config) if isinstance(src, torch.nn.Module)
                                else StreamingEngine.from_pretrained(str(src), self._engine.config))
            share_device(self._engine, self._ref_engine)   # (its slots stay on the device: generation's room)
        return self._ref_engine

    def generation_text(self, prompt_tokens: int) -> str:
        """Where completions are sampled (and the decoder's KV cache kept) and why, for prompts of
        ``prompt_tokens`` tokens at most (the run header's ``generation:`` line); once the first
        generation batch is made, where they were (:attr:`generation_where`)."""
        rows = self.args.generation_batch_size // self.dist.world
        return self.generation_where or generation_words(self._engine, self.generation, rows,
                                                         prompt_tokens + self.args.max_completion_length)

    def _completions(self, prompts, prompt_ids, mine: range):
        """Sampled completions (ids, text or messages) on the current weights: this rank makes the
        rows ``mine``, the others theirs, gathered (each rollout with its own stream: grpo_ranks.py)."""
        if self._policy is None:   # (the first generation batch's shape decides "auto")
            length = max(map(len, prompt_ids)) + self.args.max_completion_length
            self._policy = make_policy(self._engine, self.generation, len(mine), length)
            self.generation_where = generation_words(self._engine, self.generation, len(mine), length)
        self._policy.refresh(self._engine, self.state.global_step)
        kw = {}
        if self.rollout_seeds == "per_rollout":
            self._sampling_base = sampling_base(self.dist)
            kw = {"generator": row_generators(self._sampling_base, mine), "more": lockstep(self.dist)}
        ids = self._policy.generate([prompt_ids[i] for i in mine], self.generation_config,
                                    self.tokenizer.pad_token_id, self.eos_token_ids, **kw)
        self._policy.release()   # (training runs beside none of generation's memory: resident_fits' room)
        ids = gather_lists(self.dist, ids)
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        from trl.data_utils import is_conversational

        if is_conversational({"prompt": prompts[0]}):
            return ids, [[{"role": "assistant", "content": t}] for t in texts]
        return ids, texts

    def make_rollouts(self, examples: list, mode: str = "train") -> dict:
        """A generation batch's rollouts, TRL's keys: tokens and masks, advantages, the token count,
        old log-probs (when a generation serves several steps) and the reference's (beta > 0).
        ``mode="eval"``: TRL's evaluation (``num_generations_eval``, its own metrics, no tokens counted)."""
        a, tok = self.args, self.tokenizer
        train = mode == "train"
        m = self._metrics if train else self.eval_metrics
        G = a.num_generations if train else (a.num_generations_eval or a.num_generations)
        rows_at_once = a.per_device_train_batch_size if train else a.per_device_eval_batch_size
        prompts = [x["prompt"] for x in examples]
        prompt_ids = tokenize_prompts(tok, copy.deepcopy(prompts), a.chat_template_kwargs)
        mine = rank_rows(len(prompts), self.dist.rank, self.dist.world)   # this rank's rollouts (all: one process)
        completion_ids, completions = self._completions(prompts, prompt_ids, mine)
        if train:   # (every rank holds the generation batch's rollouts)
            self._rollout_tokens += sum(map(len, prompt_ids)) + sum(map(len, completion_ids))
        m["num_tokens"] = [float(self._rollout_tokens)]
        stops = [*self.eos_token_ids, tok.pad_token_id]
        for k, v in length_metrics(completion_ids, stops).items():
            m[k].append(v)
        r = pad_rollouts(prompt_ids, completion_ids, tok.pad_token_id)
        if a.mask_truncated_completions:
            truncated = torch.tensor([ids[-1] not in stops for ids in completion_ids])
            r["completion_mask"] = r["completion_mask"] * (~truncated)[:, None].int()
        rows = self._logp_batch(r)
        P = r["prompt_ids"].shape[1]
        old = ref = None
        part = {k: v[mine.start:mine.stop] for k, v in rows.items()}   # this rank's rows, gathered after
        if a.gradient_accumulation_steps % (a.steps_per_generation * self.num_iterations) != 0:
            old = gather_rows(self.dist, completion_logps(self._engine, part, P, a.temperature, rows_at_once))
        if a.beta != 0.0:
            ref = gather_rows(self.dist, completion_logps(self._reference_engine(), part, P, a.temperature,
                                                          rows_at_once))
        extra = {"trainer_state": self.state, "log_extra": lambda *x, **k: None, "log_metric": self._log_metric}
        per_func = gather_rewards(self.dist, lambda: score(
            self.reward_funcs, self.reward_func_names, self.reward_processing_classes, examples[mine.start:mine.stop],
            prompts[mine.start:mine.stop], completions[mine.start:mine.stop], completion_ids[mine.start:mine.stop],
            extra, a.chat_template_kwargs))
        adv, zero_std = advantages(per_func, self.reward_weights, G, a.scale_rewards, a.multi_objective_aggregation)
        rm = reward_metrics(per_func, self.reward_weights, self.reward_func_names, zero_std)
        for k, v in rm.items():
            m[k].append(v)
        if train:
            self.last_rollout = {"reward": rm["reward"], "reward_std": rm["reward_std"],
                                 "completion_length": m["completions/mean_length"][-1],
                                 **{k: v for k, v in rm.items() if k.startswith("rewards/") and k.endswith("/mean")}}
        out = {**r, "advantages": adv, "num_items_in_batch": torch.tensor(float(int(r["completion_mask"].sum())))}
        if old is not None:
            out["old_per_token_logps"] = old
        if ref is not None:
            out["ref_per_token_logps"] = ref
        return out

    def shuffle_rollouts(self, rollouts: dict) -> dict:
        """The generation batch's rows shuffled as TRL shuffles them (``rollout_seeds="per_rollout"``:
        the permutation from the generation's base seed, the same on every rank)."""
        if self.rollout_seeds == "per_rollout":
            return seeded_shuffle(rollouts, self._sampling_base)
        from trl.trainer.utils import shuffle_sequence_dict

        return shuffle_sequence_dict(rollouts)

    @staticmethod
    def _logp_batch(r: dict) -> dict:
        P = r["prompt_ids"].shape[1]
        ids = torch.cat([r["prompt_ids"], r["completion_ids"]], 1)
        am = torch.cat([r["prompt_mask"], r["completion_mask"]], 1)
        labels = ids.masked_fill(am == 0, -100)
        labels[:, :P] = -100
        return {"input_ids": ids, "attention_mask": am, "labels": labels}

    def rollout_state(self) -> dict:
        """What a checkpoint keeps of the rollouts' bookkeeping (JSON): TRL's metrics not yet
        logged, the objective's, the tokens counted (``num_tokens``) and the latest rollout's record."""
        return {"metrics": {k: [_num(x) for x in v] for k, v in self._metrics.items()},
                "train_metrics": {k: [_num(x) for x in v] for k, v in self.train_metrics.lists.items()},
                "rollout_tokens": int(self._rollout_tokens),
                "last_rollout": {k: _num(v) for k, v in self.last_rollout.items()}}

    def load_rollout_state(self, state: dict) -> None:
        """:meth:`rollout_state` back (a resume)."""
        self._metrics = defaultdict(list, {k: list(v) for k, v in (state.get("metrics") or {}).items()})
        self.train_metrics.lists = {k: list(v) for k, v in (state.get("train_metrics") or {}).items()}
        self._rollout_tokens = int(state.get("rollout_tokens", 0))
        self.last_rollout = dict(state.get("last_rollout") or {})

    def _log_metric(self, name: str, value: float) -> None:
        self._metrics[name].append(float(value))

    # ------------------------------------------------------------------ metrics
    def log(self, logs: dict) -> None:
        """As ``Trainer.log``, with TRL's GRPO metrics (their means since the last log)."""
        if "loss" in logs:
            metrics = {}
            for k, v in self._metrics.items():
                valid = [x for x in v if not math.isnan(x)]
                metrics[k] = sum(valid) / len(valid) if valid else None
            self._metrics = defaultdict(list)
            metrics.update(self.train_metrics.take())
            logs = {**logs, **metrics}
        super().log(logs)

    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict:
        """TRL's evaluation: rollouts of the eval prompts, the loss forward only (:mod:`.grpo_eval`)."""
        ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        if ds is None:
            raise ValueError("evaluate() needs an eval_dataset (give one to the GRPOTrainer or to evaluate())")
        metrics = run_evaluation(self, ds, metric_key_prefix)
        super().log(dict(metrics))
        self.metrics_log.write({"event": "evaluate", **metrics, "step": self.state.global_step, "time": time.time()})
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def fork_trainer(self, *, model, args, train_dataset, eval_dataset=None, loss_fn=None, **_same):
        """The trainer of a fork (``Session.fork``, notebook/branches.py) on ``model`` (this run's
        engine, or a sibling): the same reward functions and tokenizer, ``args`` with the fork's
        changes (``temperature``, ``beta``, ``learning_rate``...), the reference from this run's
        starting weights."""
        if loss_fn is not None and loss_fn is not self.loss_fn:
            raise ValueError("a GRPO fork cannot change loss_fn: GRPOConfig.loss_type picks the loss")
        if args.beta != 0.0 and self._ref_source is None:
            raise ValueError(f"fork(beta={args.beta}): this run kept no starting weights for a reference (it started "
                             "from a module with beta=0); start the run with beta > 0, or from a model folder")
        return GRPOTrainer(model=model, reward_funcs=self.reward_funcs, args=args, train_dataset=train_dataset,
                           eval_dataset=eval_dataset, processing_class=self.tokenizer,
                           reward_processing_classes=self.reward_processing_classes, ref_model=self._ref_source,
                           rollout_seeds=self.rollout_seeds)

    def close(self) -> None:
        """As :meth:`Trainer.close`, and the reference's engine when one was built."""
        if self._ref_engine is not None:
            self._ref_engine.close()
            self._ref_engine = None
        super().close()


try:   # GRPOConfig re-exported when trl is installed
    from trl import GRPOConfig  # noqa: F401
except ImportError:   # pragma: no cover
    GRPOConfig = None

__all__ = ["GRPOTrainer", "GRPOConfig", "coerce_grpo_args", "validate_grpo_args"]
