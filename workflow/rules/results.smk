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


rule evaluate:
    """The evaluation framework (sec:eval_framework) on the baseline optimiser's run of one setup."""
    input:
        run=lambda wc: summary(wc.setup, baseline(wc.setup), config["evaluation_seed"]),
        code=IEF_CODE,
    output:
        f"{RESULTS}/eval/{{setup}}.csv",
    log:
        f"{RESULTS}/logs/evaluate-{{setup}}.log",
    params:
        seed=config["evaluation_seed"],
        knobs=lambda wc: evaluation_flags(wc.setup),
    resources:
        runtime=config["slurm_time"]["evaluate_minutes"][SCALE],
    shell:
        "{PYTHON} -m ief evaluate --setup {wildcards.setup} --scale {SCALE} --seed {params.seed} --runs {RUNS} "
        "{params.knobs} --out {output} > {log} 2>&1"
