"""``ief.hf.IEFTrainer``: ``transformers.Trainer`` driving the ief optimisers.

Oracle: the same steps driven by hand with ``ief.optim`` (no ``ief.hf``): the same float64 model init, the same
batches in the same order (sequential sampling, built here from the rows), targets built here position by position
(the causal-LM shift and peft's virtual-token prefix written out), the learning-rate schedule written out, weight
decay groups chosen by name. Trainer runs must equal them to rounding; resumed runs must equal uninterrupted ones.
"""
from __future__ import annotations

import functools
import os
import re
import warnings

import datasets
import peft
import pytest
import torch
import transformers
from transformers import TrainerCallback, TrainingArguments

import ief
from ief.hf import OPTIMIZERS, IEFTrainer, split_batch

IGNORE = -100
VOCAB = 20


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    yield


# ------------------------------------------------------------------------------------------------- models & data
def bert_lora(seed: int = 0) -> torch.nn.Module:
    """A tiny float64 BERT classifier from a config (no dropout), LoRA on query/value, classifier trained."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(cfg).double(),
                                peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value"]))
    with torch.no_grad():  # LoRA B starts at 0: a generic point
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return model


def llama(seed: int = 0, adapter: str = "lora") -> torch.nn.Module:
    """A tiny float64 LlamaForCausalLM from a config with peft LoRA or prompt tuning (3 virtual tokens)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(cfg).double()
    if adapter == "lora":
        config = peft.LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    else:
        config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    model = peft.get_peft_model(base, config).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return model


def t5_lora(seed: int = 0) -> torch.nn.Module:
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
                                num_heads=2, relative_attention_num_buckets=4, relative_attention_max_distance=8,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    return peft.get_peft_model(transformers.T5ForConditionalGeneration(cfg).double(),
                               peft.LoraConfig(task_type="SEQ_2_SEQ_LM", r=2, target_modules=["q", "v"],
                                               lora_dropout=0.0))


def classification_rows(n: int = 16, t: int = 6, seed: int = 1) -> dict[str, list]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, VOCAB, (n, t), generator=g).tolist(),
            "labels": torch.randint(0, 3, (n,), generator=g).tolist()}


def lm_rows(n: int = 8, t: int = 6, seed: int = 2) -> dict[str, list]:
    """Causal-LM rows as Hugging Face builds them: labels = input_ids, -100 on right padding (mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    for i in range(n):
        pad = i % 3
        if pad:
            ids[i, -pad:] = 0
            mask[i, -pad:] = 0
    labels = ids.masked_fill(mask == 0, IGNORE)
    return {"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()}


def hand_batches(rows: dict[str, list], size: int) -> list[dict[str, torch.Tensor]]:
    """The rows in order, ``size`` at a time, as tensors (what the Trainer's sequential loader yields)."""
    n = len(rows["labels"])
    return [{k: torch.tensor(v[i:i + size]) for k, v in rows.items()} for i in range(0, n, size)]


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]).clone()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def arguments(tmp_path, **overrides) -> TrainingArguments:
    values = dict(output_dir=str(tmp_path / "out"), learning_rate=0.5, max_grad_norm=0.0,
                  per_device_train_batch_size=4, per_device_eval_batch_size=8, logging_steps=1,
                  report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no",
                  train_sampling_strategy="sequential", seed=0)
    values.update(overrides)
    return TrainingArguments(**values)


def logged(trainer, key: str = "loss") -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def linear_with_warmup(step: int, warmup: int, total: int) -> float:
    """transformers' "linear" schedule, written out: the multiplier of the base rate at optimiser step ``step``."""
    if step < warmup:
        return step / warmup
    return max(0.0, (total - step) / (total - warmup))


# --------------------------------------------------------------------------- Trainer run == the same steps by hand
CASES = {
    "ief": dict(optimizer_kwargs={"momentum": 0.9, "damping": 1e-3}),
    "iekfac": dict(optimizer_kwargs={"damping": 0.1, "factor_decay": 0.5, "inverse_every": 2, "momentum": 0.5}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_trainer_run_equals_the_same_steps_driven_by_hand(tmp_path, name):
    """4 steps of a BERT-LoRA classifier with momentum, weight decay (Trainer's groups: none on the bias), a linear
    schedule with one warm-up step (rate 0 at step 0) and evaluation: parameters, logged losses and eval_loss equal
    the hand-driven optimiser's."""
    kwargs = CASES[name]["optimizer_kwargs"]
    rows, steps, wd, lr = classification_rows(), 4, 0.1, 0.5
    model = bert_lora()
    args = arguments(tmp_path, max_steps=steps, weight_decay=wd, lr_scheduler_type="linear", warmup_steps=1,
                     eval_strategy="steps", eval_steps=steps)
    eval_rows = classification_rows(n=8, seed=9)
    trainer = IEFTrainer(model, args, train_dataset=datasets.Dataset.from_dict(rows),
                         eval_dataset=datasets.Dataset.from_dict(eval_rows), optimizer=name, optimizer_kwargs=kwargs)
    trainer.train()

    hand = bert_lora()
    named = [(n, p) for n, p in hand.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if "bias" not in n], "weight_decay": wd},
              {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0}]
    assert groups[1]["params"], "the test needs a trainable bias (the classifier's) to check the no-decay group"
    if name == "ief":
        opt = ief.optim.IEF(hand, lr=lr, params=groups, **kwargs)
    else:
        opt = ief.optim.KFAC(hand, name, lr, params=groups, **kwargs)
    hand.train()
    losses = []
    for t, batch in enumerate(hand_batches(rows, 4)[:steps]):
        for group in opt.param_groups:
            group["lr"] = lr * linear_with_warmup(t, 1, steps)
        with torch.no_grad():
            losses.append(float(hand(**batch).loss))  # the model's own mean loss, before the step
        opt.step({"input_ids": batch["input_ids"]}, batch["labels"])
    assert rel(flat(model), flat(hand)) < 1e-10
    assert rel(flat(model), flat(bert_lora())) > 1e-2  # it moved
    assert logged(trainer) == pytest.approx(losses, rel=1e-6)
    assert logged(trainer, "learning_rate") == pytest.approx([lr * linear_with_warmup(t, 1, steps)
                                                               for t in range(steps)], abs=1e-15)
    with torch.no_grad():
        batch = hand_batches(eval_rows, 8)[0]
        expected = float(hand.eval()(**batch).loss)
    assert logged(trainer, "eval_loss") == pytest.approx([expected], rel=1e-10)
    assert "grad_norm" not in trainer.state.log_history[0]  # no .grad: nothing to report


@pytest.mark.parametrize("name, kwargs", [("ief", {"reduction": "mean", "lr_is": 100.0}), ("ef", {}), ("sf", {})],
                         ids=["ief-mean", "ef", "sf"])
def test_one_step_of_each_exact_optimiser_equals_its_hand_step(tmp_path, name, kwargs):
    """EF and SF (normalised updates; SF's labels drawn from a generator seeded with TrainingArguments.seed) and iEF
    with reduction="mean" (the logged loss is the step's L / K either way): one Trainer step equals the hand step."""
    kwargs = dict(kwargs)
    lr = kwargs.pop("lr_is", 0.05)
    rows = classification_rows(n=4)
    model = bert_lora()
    trainer = IEFTrainer(model, arguments(tmp_path, max_steps=1, learning_rate=lr, seed=3),
                         train_dataset=datasets.Dataset.from_dict(rows), optimizer=name, optimizer_kwargs=kwargs)
    trainer.train()
    hand = bert_lora()
    batch = hand_batches(rows, 4)[0]
    with torch.no_grad():
        expected_loss = float(hand(**batch).loss)
    cls = {"ief": ief.optim.IEF, "ef": ief.optim.EF, "sf": ief.optim.SF}[name]
    extra = {"generator": torch.Generator().manual_seed(3)} if name == "sf" else {}
    cls(hand, lr=lr, **kwargs, **extra).step({"input_ids": batch["input_ids"]}, batch["labels"])
    assert rel(flat(model), flat(hand)) < 1e-10
    assert logged(trainer) == pytest.approx([expected_loss], rel=1e-6)


def test_causal_lm_labels_are_shifted_as_a_hand_shifted_run(tmp_path):
    """Llama-LoRA with Hugging Face's labels (= input_ids, -100 on padding): the Trainer equals a hand loop whose
    targets are shifted here position by position, and not the unshifted run; the logged loss is the model's own."""
    rows, lr = lm_rows(), 0.5
    model = llama()
    trainer = IEFTrainer(model, arguments(tmp_path, max_steps=2, learning_rate=lr, lr_scheduler_type="constant"),
                         train_dataset=datasets.Dataset.from_dict(rows), optimizer="ief")
    trainer.train()

    def hand_run(shift: bool):
        hand = llama()
        opt = ief.optim.IEF(hand, lr=lr)
        losses = []
        for batch in hand_batches(rows, 4):
            labels = batch["labels"]
            targets = torch.full_like(labels, IGNORE)
            for n in range(labels.shape[0]):
                for t in range(labels.shape[1]):
                    if not shift:
                        targets[n, t] = labels[n, t]
                    elif t + 1 < labels.shape[1]:
                        targets[n, t] = labels[n, t + 1]
            with torch.no_grad():
                losses.append(float(hand(**batch).loss))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the unshifted run is warned about; that is its point
                opt.step({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, targets)
        return hand, losses

    shifted, losses = hand_run(True)
    assert rel(flat(model), flat(shifted)) < 1e-10
    assert logged(trainer) == pytest.approx(losses, rel=1e-6)
    unshifted, _ = hand_run(False)
    assert rel(flat(model), flat(unshifted)) > 1e-3


def test_prompt_tuning_causal_lm_prepends_the_virtual_tokens_before_the_shift(tmp_path):
    """peft prompt tuning on a causal LM: the logits have 3 + T positions and the last virtual token predicts
    labels[0]; the Trainer (which patches the model with ief.per_sample_prompts: no slow path) equals a hand loop
    on an unpatched twin (the exact slow path) with those targets written out."""
    rows, lr, virtual = lm_rows(n=4), 0.5, 3
    model = llama(adapter="prompt")
    trainer = IEFTrainer(model, arguments(tmp_path, max_steps=1, learning_rate=lr),
                         train_dataset=datasets.Dataset.from_dict(rows), optimizer="ief")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ief.SlowPathWarning)
        trainer.train()

    hand = llama(adapter="prompt")
    batch = hand_batches(rows, 4)[0]
    labels = batch["labels"]
    full = torch.cat([torch.full((labels.shape[0], virtual), IGNORE), labels], dim=1)
    targets = torch.full_like(full, IGNORE)
    targets[:, :-1] = full[:, 1:]
    assert (targets[:, virtual - 1] == labels[:, 0]).all()
    with torch.no_grad():
        expected_loss = float(hand(**batch).loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ief.SlowPathWarning)
        ief.optim.IEF(hand, lr=lr).step({"input_ids": batch["input_ids"],
                                         "attention_mask": batch["attention_mask"]}, targets)
    assert rel(flat(model), flat(hand)) < 1e-10
    assert logged(trainer) == pytest.approx([expected_loss], rel=1e-6)


def test_encoder_decoder_gets_decoder_inputs_from_labels(tmp_path):
    """T5-LoRA: the labels are the targets unshifted and decoder_input_ids are the labels shifted right (start token
    0, -100 -> pad 0), as T5 does when given labels; one Trainer step equals that step by hand."""
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(2, VOCAB, (4, 3), generator=g)
    labels[1, 2] = IGNORE
    rows = {"input_ids": torch.randint(2, VOCAB, (4, 5), generator=g).tolist(), "labels": labels.tolist()}
    model = t5_lora()
    trainer = IEFTrainer(model, arguments(tmp_path, max_steps=1), train_dataset=datasets.Dataset.from_dict(rows),
                         optimizer="ief")
    trainer.train()
    hand = t5_lora()
    decoder = torch.zeros_like(labels)
    decoder[:, 1:] = labels[:, :-1].clamp_min(0)
    ief.optim.IEF(hand, lr=0.5).step({"input_ids": torch.tensor(rows["input_ids"]),
                                       "decoder_input_ids": decoder}, labels)
    assert rel(flat(model), flat(hand)) < 1e-10


# ----------------------------------------------------------------------------------------- checkpoints and resume
class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


RESUME = {
    "ief": dict(momentum=0.9, damping=1e-3),
    "kfac": dict(damping=0.1, factor_decay=0.5, inverse_every=3, momentum=0.5),  # sampled labels: the generator
}


@pytest.mark.parametrize("name", sorted(RESUME))
def test_interrupted_and_resumed_run_equals_the_uninterrupted_run(tmp_path, name):
    """Random sampling, a linear schedule, momentum (and for K-FAC running factors, an eigendecomposition from
    step 0 reused at step 2, sampled labels): stopping after the step-2 checkpoint and resuming from it in a new
    Trainer on a fresh model gives the uninterrupted run's parameters, bit for bit; resuming without the optimiser
    state (optimizer.pt removed) does not."""
    rows = classification_rows()
    common = dict(max_steps=4, lr_scheduler_type="linear", train_sampling_strategy="random", weight_decay=0.01)

    def trainer(directory, **extra):
        args = arguments(tmp_path / directory, **common, **extra)
        return IEFTrainer(bert_lora(), args, train_dataset=datasets.Dataset.from_dict(rows), optimizer=name,
                          optimizer_kwargs=RESUME[name])

    whole = trainer("whole")
    whole.train()
    first = trainer("split", save_strategy="steps", save_steps=2)
    first.add_callback(StopAt(2))
    first.train()
    checkpoint = tmp_path / "split" / "out" / "checkpoint-2"
    assert first.state.global_step == 2 and (checkpoint / "optimizer.pt").is_file()
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert all("momentum_buffer" in entry for entry in saved["state"].values())
    if name == "kfac":  # the running factors and the sampling generator travel with the checkpoint
        assert saved["kfac"]["factors"] and "generator_state" in saved
    resumed = trainer("split", save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert torch.equal(flat(resumed.model), flat(whole.model))
    assert logged(resumed) == logged(whole)  # the first two from the checkpoint's trainer_state.json
    if name == "ief":
        os.remove(checkpoint / "optimizer.pt")  # the Trainer then resumes without optimiser (or scheduler) state
        blind = trainer("split", save_strategy="steps", save_steps=2)
        blind.train(resume_from_checkpoint=str(checkpoint))
        assert rel(flat(blind.model), flat(whole.model)) > 1e-3


# ------------------------------------------------------------------------------------------ gradient accumulation
def test_gradient_accumulation_takes_the_exact_step_of_the_union_batch(tmp_path):
    """gradient_accumulation_steps=2 with batches of 2 equals batches of 4 (the same samples), losses included."""
    rows = classification_rows(n=8)
    runs = []
    for size, accumulate in ((4, 1), (2, 2)):
        model = bert_lora()
        trainer = IEFTrainer(model, arguments(tmp_path / str(size), max_steps=2, per_device_train_batch_size=size,
                                              gradient_accumulation_steps=accumulate),
                             train_dataset=datasets.Dataset.from_dict(rows), optimizer="ief",
                             optimizer_kwargs={"momentum": 0.5})
        trainer.train()
        runs.append((flat(model), logged(trainer)))
    assert rel(runs[1][0], runs[0][0]) < 1e-10
    assert runs[1][1] == pytest.approx(runs[0][1], rel=1e-6)


def test_gradient_accumulation_refuses_micro_batches_of_different_lengths(tmp_path):
    rows = {"input_ids": [[1 + i % 5] * (3 + i % 2) for i in range(4)], "labels": [0, 1, 2, 0]}

    def pad_to_longest(features):
        longest = max(len(f["input_ids"]) for f in features)
        return {"input_ids": torch.tensor([f["input_ids"] + [0] * (longest - len(f["input_ids"]))
                                           for f in features]),
                "labels": torch.tensor([f["labels"] for f in features])}

    trainer = IEFTrainer(bert_lora(), arguments(tmp_path, max_steps=1, per_device_train_batch_size=1,
                                                gradient_accumulation_steps=2),
                         train_dataset=datasets.Dataset.from_dict(rows), data_collator=pad_to_longest)
    with pytest.raises(ValueError, match=r"'input_ids' has shapes \[\(1, 3\), \(1, 4\)\]; pad every batch"):
        trainer.train()


# ---------------------------------------------------------------------------------------------------- refusals
def test_bad_optimizer_name_names_the_accepted_ones(tmp_path):
    with pytest.raises(ValueError) as err:
        IEFTrainer(bert_lora(), arguments(tmp_path), optimizer="adamw")
    assert "'adamw'" in str(err.value) and all(f"'{name}'" in str(err.value) for name in OPTIMIZERS)


@pytest.mark.parametrize("given, match", [
    (dict(optimizer_kwargs={"lr": 1.0}), "may not contain 'lr': the rate is TrainingArguments"),
    (dict(optimizer_kwargs={"weight_decay": 0.1}), "may not contain 'weight_decay'"),
    (dict(optimizers=(None, torch.optim.lr_scheduler.LambdaLR)), "builds its optimiser itself"),
    (dict(compute_loss_func=lambda *a, **k: 0), "does not take compute_loss_func"),
    (dict(optimizer_kwargs={"momentum": 1.5}), r"momentum must be a number in \[0, 1\)"),
])
def test_refused_arguments(tmp_path, given, match):
    with pytest.raises(ValueError, match=match):
        IEFTrainer(bert_lora(), arguments(tmp_path), **given)


def test_a_kfac_kind_takes_kfacs_default_damping(tmp_path):
    trainer = IEFTrainer(bert_lora(), arguments(tmp_path), optimizer="ekfac")
    assert trainer.ief_optimizer.param_groups[0]["damping"] == 1e-3 and trainer.ief_optimizer.kind == "ekfac"


@pytest.mark.parametrize("setting, match", [
    (dict(fp16=True), "refuses fp16=True"),
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1"),
    (dict(label_names=["targets"]), "label_names=\\['targets'\\] is not supported"),
])
def test_refused_training_arguments(tmp_path, setting, match):
    try:
        args = arguments(tmp_path, **setting)
    except ValueError:  # a transformers version may refuse the setting itself on this machine
        args = arguments(tmp_path)
        for key, value in setting.items():
            setattr(args, key, value)
    with pytest.raises(ValueError, match=match):
        IEFTrainer(bert_lora(), args)


def test_kfac_refuses_prompt_tuning_by_name_at_construction(tmp_path):
    with pytest.raises(ValueError, match="prompt_encoder"):
        IEFTrainer(llama(adapter="prompt"), arguments(tmp_path), optimizer="kfac",
                   optimizer_kwargs={"damping": 0.1})


def test_max_grad_norm_and_default_learning_rate_are_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="max_grad_norm=1.0 is ignored by IEFTrainer"):
        IEFTrainer(bert_lora(), arguments(tmp_path, max_grad_norm=1.0))
    with pytest.warns(UserWarning, match="learning_rate is TrainingArguments' default 5e-05"):
        IEFTrainer(bert_lora(), arguments(tmp_path, learning_rate=5e-5))


def test_loop_step_without_a_batch_step_before_it_raises(tmp_path):
    trainer = IEFTrainer(bert_lora(), arguments(tmp_path))
    with pytest.raises(RuntimeError, match="no batch step preceded it"):
        trainer.ief_optimizer.step()


def test_split_batch_needs_labels():
    with pytest.raises(ValueError, match=r"under 'labels'.*\['input_ids'\]"):
        split_batch(bert_lora(), {"input_ids": torch.ones(2, 3, dtype=torch.long)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kfac_resume_on_a_gpu_equals_the_uninterrupted_run(tmp_path):
    """On a GPU the Trainer loads optimizer.pt with map_location="cpu": the running factors, eigendecompositions and
    the CUDA generator's state must come back on the parameters' device, and the resumed run equal the whole one."""
    rows = classification_rows()

    def trainer(directory, **extra):
        args = arguments(tmp_path / directory, use_cpu=False, max_steps=4, lr_scheduler_type="linear", **extra)
        return IEFTrainer(bert_lora(), args, train_dataset=datasets.Dataset.from_dict(rows), optimizer="kfac",
                          optimizer_kwargs=RESUME["kfac"])

    whole = trainer("whole")
    whole.train()
    assert next(whole.model.parameters()).is_cuda
    first = trainer("split", save_strategy="steps", save_steps=2)
    first.add_callback(StopAt(2))
    first.train()
    resumed = trainer("split", save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "split" / "out" / "checkpoint-2"))
    assert rel(flat(resumed.model), flat(whole.model)) < 1e-10  # (CUDA kernels need not be bitwise reproducible)


# --------------------------------------------------------------------------- a checkpoint of another optimiser
def test_resuming_a_checkpoint_of_another_optimiser_is_refused_naming_it(tmp_path):
    """An optimizer="ief" checkpoint resumed with optimizer="ef" (before: EF ran with iEF's saved normalize=False
    and damping, step norm 13.0 where 0.5 was asked) and a plain transformers.Trainer's AdamW checkpoint (before:
    torch's "different number of parameter groups") are refused: the checkpoint holds another optimiser, and how to
    start fresh."""
    rows = datasets.Dataset.from_dict(classification_rows(n=8))
    args = arguments(tmp_path / "ief", max_steps=2, save_strategy="steps", save_steps=2)
    IEFTrainer(bert_lora(), args, train_dataset=rows, optimizer="ief").train()
    checkpoint = tmp_path / "ief" / "out" / "checkpoint-2"
    other = IEFTrainer(bert_lora(), arguments(tmp_path / "ef", max_steps=4), train_dataset=rows, optimizer="ef",
                       optimizer_kwargs={"damping": 1e-2})
    with pytest.raises(ValueError, match=r"checkpoint .*checkpoint-2 holds another optimiser's state, not this "
                                         r"IEFTrainer's optimizer='ef' \(this state_dict is IEF\(normalize=False.*"
                                         r"into EF\(normalize=True.*train\(\) without resume_from_checkpoint"):
        other.train(resume_from_checkpoint=str(checkpoint))

    plain_args = arguments(tmp_path / "adamw", max_steps=2, save_strategy="steps", save_steps=2, learning_rate=1e-3)
    transformers.Trainer(bert_lora(), plain_args, train_dataset=rows).train()
    adamw = tmp_path / "adamw" / "out" / "checkpoint-2"
    trainer = IEFTrainer(bert_lora(), arguments(tmp_path / "resume", max_steps=4), train_dataset=rows)
    with pytest.raises(ValueError, match=r"holds another optimiser's state, not this IEFTrainer's optimizer='ief' "
                                         r"\(this state_dict is not an ief optimiser's .*'betas'.*AdamW"):
        trainer.train(resume_from_checkpoint=str(adamw))


# ------------------------------------------------------------------------------------------------- regression
def bert_regression(seed: int = 0) -> torch.nn.Module:
    """A tiny float64 BERT with a one-output regression head (num_labels=1, problem_type="regression")."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=16, num_labels=1,
                                  problem_type="regression", hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(cfg).double()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_regression_logs_the_models_mean_squared_error_and_takes_hf_labels(tmp_path, reduction):
    """Hugging Face regression labels [M] (refused before: "targets shape (8,) does not match logits shape (8, 1)")
    train a num_labels=1 head with loss="mse"; the logged loss is the model's outputs.loss on the batch before the
    step (before: half of it, l_n = 1/2 ||z - y||^2), and the update is the hand step with [M, 1] targets."""
    g = torch.Generator().manual_seed(4)
    rows = {"input_ids": torch.randint(1, VOCAB, (8, 6), generator=g).tolist(),
            "labels": torch.randn(8, generator=g, dtype=torch.float64).tolist()}
    model = bert_regression()
    kwargs = {"loss": "mse", "damping": 1e-3, "reduction": reduction}
    trainer = IEFTrainer(model, arguments(tmp_path, max_steps=1, learning_rate=0.05, per_device_train_batch_size=8),
                         train_dataset=datasets.Dataset.from_dict(rows), optimizer="ief", optimizer_kwargs=kwargs)
    out = trainer.train()
    hand = bert_regression()
    ids, labels = torch.tensor(rows["input_ids"]), torch.tensor(rows["labels"], dtype=torch.float64)
    with torch.no_grad():
        expected = float(hand(input_ids=ids, labels=labels).loss)
    ief.optim.IEF(hand, lr=0.05, **kwargs).step({"input_ids": ids}, labels[:, None])
    assert logged(trainer) == pytest.approx([expected], rel=1e-6)
    assert out.training_loss == pytest.approx(expected, rel=1e-6)
    assert rel(flat(model), flat(hand)) < 1e-6
    assert rel(flat(model), flat(bert_regression())) > 1e-3  # it moved


# ------------------------------------------------------------------------------------- names in any case, lr="auto"
@pytest.mark.parametrize("given, name", [("IEF", "ief"), ("EKFAC", "ekfac"), ("Sf", "sf")])
def test_optimizer_names_are_taken_in_any_case(tmp_path, given, name):
    trainer = IEFTrainer(bert_lora(), arguments(tmp_path), optimizer=given,
                         optimizer_kwargs={"damping": 1e-3} if name != "ekfac" else {})
    assert trainer.optimizer_name == name


def test_a_misspelled_optimizer_name_gets_the_closest():
    with pytest.raises(ValueError, match=r"got 'ieff' \(did you mean 'ief'\?\)"):
        ief.hf._optimizer_name("ieff")


def test_lr_auto_trains_with_the_adapted_rate_and_no_schedule(tmp_path):
    """``optimizer_kwargs={"lr": "auto"}``: the Trainer's steps equal ``IEF(lr="auto")`` driven by hand on the same
    batches (the linear schedule is not applied, and says so), and the logged rate is the optimiser's."""
    rows = classification_rows()
    with pytest.warns(UserWarning, match="learning_rate and lr_scheduler_type='linear'.*are not applied"):
        trainer = IEFTrainer(bert_lora(), arguments(tmp_path, max_steps=3, lr_scheduler_type="linear"),
                             train_dataset=datasets.Dataset.from_dict(rows),
                             optimizer_kwargs={"lr": "auto", "damping": 1e-3})
    trainer.train()
    model = bert_lora()
    opt = ief.optim.IEF(model, lr="auto", damping=1e-3)
    for batch in hand_batches(rows, 4)[:3]:
        labels = batch.pop("labels")
        opt.step(batch, labels)
    assert rel(flat(trainer.model), flat(model)) < 1e-10
    assert logged(trainer, "learning_rate")[-1] == pytest.approx(opt.last_lr)


def test_lr_auto_is_refused_for_kfac_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="KFAC has no adapted rate"):
        IEFTrainer(bert_lora(), arguments(tmp_path), optimizer="kfac", optimizer_kwargs={"lr": "auto"})


def test_the_trainer_logs_what_each_step_ran(tmp_path, caplog):
    """The step's certificate (method, routes, rows, processes) is logged on the first step, and again only when
    what ran changes."""
    rows = classification_rows(n=4)
    trainer = IEFTrainer(bert_lora(), arguments(tmp_path, max_steps=2, learning_rate=0.05),
                         train_dataset=datasets.Dataset.from_dict(rows), optimizer="ief")
    with caplog.at_level("INFO", logger="ief.hf"):
        trainer.train()
    logged_lines = [r.getMessage() for r in caplog.records if r.name == "ief.hf"]
    assert len(logged_lines) == 1, logged_lines
    assert logged_lines[0].startswith("IEFTrainer step 0: iEF over 4 rows on 1 process (")
    report = trainer.ief_optimizer.last_step_report
    assert report.step == 1 and report.method == "iEF" and not report.across_processes
    assert report.routes and "looped" not in report.routes.values()


@pytest.mark.parametrize("engine, reason", [
    ("is_deepspeed_enabled", "DeepSpeed's ZeRO partitions the parameters and runs its own backward"),
    ("is_fsdp_enabled", "fsdp= wrapping shards the model and builds the optimiser on accelerate's terms; shard the "
                        "model yourself with torch.distributed.fsdp.fully_shard"),
], ids=["deepspeed", "trainer-fsdp"])
def test_deepspeed_and_the_trainers_fsdp_wrapping_are_refused_with_their_reasons(engine, reason, tmp_path,
                                                                                 monkeypatch):
    original = transformers.Trainer.__init__

    @functools.wraps(original)  # (IEFTrainer binds the Trainer's signature)
    def as_if_engine(self, *args, **kwargs):
        original(self, *args, **kwargs)
        setattr(self, engine, True)

    monkeypatch.setattr(transformers.Trainer, "__init__", as_if_engine)
    with pytest.raises(ValueError, match=re.escape(reason)):
        IEFTrainer(bert_lora(), arguments(tmp_path))


def test_an_fsdp2_resume_reads_the_ranks_checkpoint_file_once(tmp_path, monkeypatch):
    """Resuming an FSDP2 model reads this rank's state file once: the model's shards are taken first, the optimiser
    state kept until the Trainer asks for it; a later resume reads the file again (nothing stale is kept)."""
    from types import SimpleNamespace

    from ief.hf import SHARDED_STATE

    for rank in range(2):
        torch.save({"model": {"w": torch.full((2,), float(rank))}, "optimizer": {"state": {}, "rank": rank}},
                   tmp_path / SHARDED_STATE.format(rank=rank, world=2))
    trainer = IEFTrainer.__new__(IEFTrainer)  # only the checkpoint reading is exercised (no model, no processes)
    trainer.args = SimpleNamespace(world_size=2, process_index=1)
    reads, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: reads.append(a[0]) or load(*a, **k))
    assert torch.equal(trainer._sharded_state(str(tmp_path), "model")["w"], torch.ones(2))
    assert trainer._sharded_state(str(tmp_path), "optimizer")["rank"] == 1
    assert reads == [str(tmp_path / SHARDED_STATE.format(rank=1, world=2))]
    assert trainer._sharded_state(str(tmp_path), "model")["w"].sum() == 2 and len(reads) == 2
