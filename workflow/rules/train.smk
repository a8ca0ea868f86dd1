"""One job per (setup, optimiser, seed): the resumable runner (companion.experiments.runner).

The output is the run's summary.json only: the runner writes it last and atomically, so a run folder without it is
an unfinished run that the same command resumes (resume.pt), and Snakemake never deletes the folder. The runner's
lock on the run folder makes a duplicated job (a SLURM requeue, two workflows at once) safe. A run depends on the code
it runs (CORE_CODE: the core and the experiments code, not the chapters' back-ends): after a change there Snakemake
removes summary.json and the runner trains the run again from step 0 (a finished run keeps no resume.pt). With
config gpus_per_train_job N > 1 a job runs the runner on N processes of one node (torchrun) and asks for N GPUs.
"""


rule train:
    input:
        code=CORE_CODE,
    output:
        f"{RUNS}/{{scale}}/{{setup}}/{{optimizer}}/seed-{{seed}}/summary.json",
    wildcard_constraints:
        scale=SCALE,  # setup, optimizer, seed: workflow/rules/common.smk
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
