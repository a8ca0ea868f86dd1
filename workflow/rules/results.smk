"""Tidy tables from the runs: the E2 tables (ief aggregate) and the evaluation framework (ief evaluate)."""


rule aggregate_e2:
    """Every finished run of the grid -> e2_runs.csv (one row per run) and e2_curves.csv (per step)."""
    input:
        runs=[summary(*run) for run in GRID],
        code=CORE_CODE,
    output:
        E2_TABLES,
    log:
        f"{RESULTS}/logs/aggregate_e2.log",
    priority: PRIORITY["normal"]
    shell:
        "{PYTHON} -m ief aggregate --scale {SCALE} --runs {RUNS} --out {RESULTS} > {log} 2>&1"


# assembling a setup's table only reads the stages' parts: on a cluster it runs on the submitting node
localrules:
    evaluate,


rule evaluate_stage:
    """The evaluation framework (sec:eval_framework, alg:eval) at one stage checkpoint of the baseline optimiser's
    run of a setup: one job per checkpoint, its records in OUT.parts/stage-PPP.csv. Snakemake removes the part before
    the job reruns, so the job computes its stage afresh (a part is reused only by the same job resuming)."""
    input:
        run=lambda wc: summary(wc.setup, baseline(wc.setup), EVALUATION_SEED),
        code=CORE_CODE,
    output:
        f"{RESULTS}/eval/{{setup}}.csv.parts/stage-{{stage}}.csv",
    log:
        f"{RESULTS}/logs/evaluate-{{setup}}-stage-{{stage}}.log",
    params:
        seed=EVALUATION_SEED,
        knobs=lambda wc: evaluation_flags(wc.setup),
        out=lambda wc: f"{RESULTS}/eval/{wc.setup}.csv",
        stage=lambda wc: int(wc.stage),
    resources:
        runtime=config["slurm_time"]["evaluate_minutes"][SCALE],
    priority: PRIORITY["first"]
    shell:
        "{PYTHON} -m ief evaluate --setup {wildcards.setup} --scale {SCALE} --seed {params.seed} --runs {RUNS} "
        "{params.knobs} --stages {params.stage} --out {params.out} > {log} 2>&1"


rule evaluate:
    """A setup's evaluation table: every stage's part (made by evaluate_stage, with the same parameters) assembled
    into one CSV; nothing is computed."""
    input:
        parts=lambda wc: eval_parts(wc.setup),
        code=CORE_CODE,
    output:
        f"{RESULTS}/eval/{{setup}}.csv",
    log:
        f"{RESULTS}/logs/evaluate-{{setup}}.log",
    params:
        seed=EVALUATION_SEED,
        knobs=lambda wc: evaluation_flags(wc.setup),
    priority: PRIORITY["first"]
    shell:
        "{PYTHON} -m ief evaluate --setup {wildcards.setup} --scale {SCALE} --seed {params.seed} --runs {RUNS} "
        "{params.knobs} --out {output} > {log} 2>&1"


rule step_costs:
    """Chapter practical.ipynb's "Cost per update": the seconds per update of the practical comparison's optimisers,
    measured side by side in one process (python -m companion step-costs), as a job of its own that runs beside the
    training runs, not in the chapter, which waits for the last run."""
    input:
        code=CORE_CODE,
    output:
        f"{RESULTS}/step_costs.csv",
    log:
        f"{RESULTS}/logs/step_costs.log",
    params:
        setups=" ".join(f"--setup {s}" for s in SETUPS),
    priority: PRIORITY["normal"]
    resources:
        runtime=config["slurm_time"]["evaluate_minutes"][SCALE],
    shell:
        "{PYTHON} -m ief step-costs --scale {SCALE} {params.setups} --out {output} > {log} 2>&1"
