"""Tidy tables from the runs: the E2 tables (python -m companion aggregate) and the evaluation framework (python -m companion evaluate)."""


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
        "{COMPANION} aggregate --scale {SCALE} --runs {RUNS} --out {RESULTS} > {log} 2>&1"


rule verdicts:
    """Every verdict the book prints, as data (python -m companion verdicts): one row per rule and subject with its
    statistic, interval, evidence and what would decide it, from the E2 tables, the per-example test predictions
    and the evaluation tables."""
    input:
        tables=E2_TABLES,
        eval=EVAL_TABLES,
        code=CORE_CODE,
    output:
        VERDICTS,
    log:
        f"{RESULTS}/logs/verdicts.log",
    priority: PRIORITY["normal"]
    shell:
        "{COMPANION} verdicts --scale {SCALE} --results {RESULTS} --runs {RUNS} > {log} 2>&1"


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
        "{COMPANION} evaluate --setup {wildcards.setup} --scale {SCALE} --seed {params.seed} --runs {RUNS} "
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
        "{COMPANION} evaluate --setup {wildcards.setup} --scale {SCALE} --seed {params.seed} --runs {RUNS} "
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
        "{COMPANION} step-costs --scale {SCALE} {params.setups} --out {output} > {log} 2>&1"


rule early_spike:
    """Chapter optimisation.ipynb's early loss spike: iEF's first update on the MLP from scratch, redone for the E2
    runs' seeds at their rate and the search's (python -m companion early-spike), a job of its own so that the
    chapter only reads."""
    input:
        tables=E2_TABLES,
        code=CORE_CODE,
    output:
        EARLY_SPIKE,
    log:
        f"{RESULTS}/logs/early_spike.log",
    priority: PRIORITY["normal"]
    resources:
        runtime=config["slurm_time"]["evaluate_minutes"][SCALE],
    shell:
        "{COMPANION} early-spike --scale {SCALE} --runs {RUNS} --results {RESULTS} --out {output} "
        "> {log} 2>&1"


rule compression:
    """Chapter compression.ipynb's study: one-shot pruning of the digits-mlp baseline with magnitude and every
    WoodFisher curvature over sparsities, dampings and draws (python -m companion compression); the chapter reads
    its tables."""
    input:
        baseline=COMPRESSION_BASELINE,
        code=CORE_CODE,
    output:
        COMPRESSION,
    log:
        f"{RESULTS}/logs/compression.log",
    params:
        out=f"{RESULTS}/compression",
    priority: PRIORITY["normal"]
    resources:
        runtime=config["slurm_time"]["evaluate_minutes"][SCALE],
    shell:
        "{COMPANION} compression --scale {SCALE} --runs {RUNS} --out {params.out} > {log} 2>&1"


rule blockdiag_check:
    """Chapter evaluation.ipynb's dense float64 check of the block-diagonal study (why ieKFAC can beat exact iEF)
    at one stage checkpoint of the baseline runs of the block-diagonal figure's setups, with their evaluation
    records (python -m companion blockdiag-check): a job of its own, so that the chapter only reads its table
    and glue. A scale without an MLP among those setups (full) requests no check (BLOCKDIAG_CHECK is empty)."""
    input:
        tables=[f"{RESULTS}/eval/{s}.csv" for s in BLOCKDIAG_SETUPS],
        runs=[summary(s, baseline(s), EVALUATION_SEED) for s in BLOCKDIAG_SETUPS],
        code=CORE_CODE,
    output:
        BLOCKDIAG_CHECK_FILES,
    log:
        f"{RESULTS}/logs/blockdiag_check.log",
    params:
        seed=EVALUATION_SEED,
    priority: PRIORITY["normal"]
    resources:
        runtime=config["slurm_time"]["evaluate_minutes"][SCALE],
    shell:
        "{COMPANION} blockdiag-check --scale {SCALE} --runs {RUNS} --results {RESULTS} "
        "--seed {params.seed} --out {output[0]} > {log} 2>&1"
