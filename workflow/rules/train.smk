"""One job per (setup, optimiser, seed) (rule ``train``), or, for a short setup's runs, one job per (setup, optimiser)
training its seeds one after another (rules ``train_seeds``, see SHORT_RUNS in common.smk): the resumable runner
(companion.experiments.runner).

The output is each run's summary.json only: the runner writes it last and atomically, so a run folder without it is
an unfinished run that the same command resumes (resume.pt), and Snakemake never deletes the folder. The runner's
lock on the run folder makes a duplicated job (a SLURM requeue, two workflows at once) safe. A run depends on the code
it runs (CORE_CODE: the core and the experiments code, not the chapters' back-ends): after a change there Snakemake
removes summary.json and the runner trains the run again from step 0 (a finished run keeps no resume.pt). With
config gpus_per_train_job N > 1 a job runs the runner on N processes of one node (torchrun) and asks for N GPUs.

A ``train_seeds`` job that stops part-way is rerun whole: Snakemake removes the summaries of the runs it had finished
(each a few seconds to train again) and the interrupted run resumes from its resume.pt.
"""


rule train:
    input:
        code=CORE_CODE,
    output:
        f"{RUNS}/{{scale}}/{{setup}}/{{optimizer}}/seed-{{seed}}/summary.json",
    wildcard_constraints:
        scale=SCALE,
        setup=ONE_RUN_SETUPS,  # optimizer, seed: workflow/rules/common.smk
    log:
        f"{RUNS}/{{scale}}/{{setup}}/{{optimizer}}/seed-{{seed}}/train.log",
    priority: train_priority
    resources:
        runtime=train_minutes,
        gpu=GPUS_PER_TRAIN_JOB,  # config gpus_per_train_job: N > 1 runs the runner under torchrun (common.smk)
        cpus_per_task=GPUS_PER_TRAIN_JOB,
    shell:
        "{TRAIN_LAUNCHER} train --setup {wildcards.setup} --optimizer {wildcards.optimizer} "
        "--seed {wildcards.seed} --scale {wildcards.scale} --out {RUNS} --no-progress > {log} 2>&1"


# One rule per distinct list of seeds among the short setups (the outputs name the seeds; the wildcards are the
# setup and the optimiser, so a job's time is still recorded per setup and optimiser).
for _number, (_seeds, _setups) in enumerate(SHORT_RUNS.items()):

    rule:
        name:
            "train_seeds" if _number == 0 else f"train_seeds_{_number}"
        input:
            code=CORE_CODE,
        output:
            [f"{RUNS}/{{scale}}/{{setup}}/{{optimizer}}/seed-{seed}/summary.json" for seed in _seeds],
        wildcard_constraints:
            scale=SCALE,
            setup=_one_of(_setups),
        log:
            f"{RUNS}/{{scale}}/{{setup}}/{{optimizer}}/train-seeds-{_seeds[0]}-{_seeds[-1]}.log",
        params:
            seeds=",".join(str(seed) for seed in _seeds),
        priority: seeds_priority(_seeds)
        resources:
            runtime=train_minutes,
            gpu=GPUS_PER_TRAIN_JOB,
            cpus_per_task=GPUS_PER_TRAIN_JOB,
        shell:
            "{TRAIN_LAUNCHER} train --setup {wildcards.setup} --optimizer {wildcards.optimizer} "
            "--seeds {params.seeds} --scale {wildcards.scale} --out {RUNS} --no-progress > {log} 2>&1"
