"""Tidy tables from the runs: the E2 tables (ief aggregate) and the evaluation framework (ief evaluate)."""


rule aggregate_e2:
    """Every finished run of the grid -> e2_runs.csv (one row per run) and e2_curves.csv (per step)."""
    input:
        runs=[summary(*run) for run in GRID],
        code=IEF_CODE,
    output:
        E2_TABLES,
    log:
        f"{RESULTS}/logs/aggregate_e2.log",
    shell:
        "{PYTHON} -m ief aggregate --scale {SCALE} --runs {RUNS} --out {RESULTS} > {log} 2>&1"


# assembling a setup's table only reads the cached parts: on a cluster it runs on the submitting node
localrules:
    evaluate,


rule evaluate_stage:
    """The evaluation framework (sec:eval_framework, alg:eval) at one stage checkpoint of the baseline optimiser's
    run of a setup: one job per checkpoint, its records cached in OUT.parts/stage-PPP.csv (+ fingerprint)."""
    input:
        run=lambda wc: summary(wc.setup, baseline(wc.setup), config["evaluation_seed"]),
        code=IEF_CODE,
    output:
        f"{RESULTS}/eval/{{setup}}.csv.parts/stage-{{stage}}.csv",
    log:
        f"{RESULTS}/logs/evaluate-{{setup}}-stage-{{stage}}.log",
    params:
        seed=config["evaluation_seed"],
        knobs=lambda wc: evaluation_flags(wc.setup),
        out=lambda wc: f"{RESULTS}/eval/{wc.setup}.csv",
        stage=lambda wc: int(wc.stage),
    resources:
        runtime=config["slurm_time"]["evaluate_minutes"][SCALE],
    shell:
        "{PYTHON} -m ief evaluate --setup {wildcards.setup} --scale {SCALE} --seed {params.seed} --runs {RUNS} "
        "{params.knobs} --stages {params.stage} --out {params.out} > {log} 2>&1"


rule evaluate:
    """A setup's evaluation table: every stage's part (all cached by evaluate_stage) assembled into one CSV."""
    input:
        parts=lambda wc: eval_parts(wc.setup),
        code=IEF_CODE,
    output:
        f"{RESULTS}/eval/{{setup}}.csv",
    log:
        f"{RESULTS}/logs/evaluate-{{setup}}.log",
    params:
        seed=config["evaluation_seed"],
        knobs=lambda wc: evaluation_flags(wc.setup),
    shell:
        "{PYTHON} -m ief evaluate --setup {wildcards.setup} --scale {SCALE} --seed {params.seed} --runs {RUNS} "
        "{params.knobs} --out {output} > {log} 2>&1"
