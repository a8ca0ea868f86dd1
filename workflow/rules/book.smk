"""Notebooks -> the book. A notebook reruns when its source, the ief package code (the chapters' back-ends and the
core code they call: IEF_CODE), the results it reads (config notebook_results) or the package versions (params)
change; the book when any chapter or source changes."""

localrules: mathjax, publish, timings, book


rule mathjax:
    """MathJax from the npm registry, once (the book is served offline)."""
    output:
        str(BOOK.MATHJAX_ENTRY.relative_to(ROOT)),
    priority: PRIORITY["normal"]
    shell:
        "{PYTHON} -m tools.book mathjax"


rule execute_notebook:
    input:
        notebook="notebooks/{name}.ipynb",
        code=IEF_CODE,
        results=lambda wc: notebook_results(wc.name),
    output:
        executed=f"{EXECUTED}/{{name}}.ipynb",
        provenance=f"{EXECUTED}/{{name}}.provenance.json",
    wildcard_constraints:
        name="|".join(NOTEBOOKS) or "no-notebooks",
    params:
        packages=BOOK.package_versions(),
    priority: PRIORITY["normal"]
    resources:
        runtime=config["slurm_time"]["notebook_minutes"][SCALE],
    shell:
        "{PYTHON} -m tools.book execute {input.notebook} --scale {SCALE} --runs-dir {RUNS} --results-dir {RESULTS} "
        "--results {input.results}"


rule publish:
    input:
        executed=f"{EXECUTED}/{{name}}.ipynb",
        provenance=f"{EXECUTED}/{{name}}.provenance.json",
        tool="tools/book/steps.py",
    output:
        "book/generated/{name}.ipynb",
    wildcard_constraints:
        name="|".join(NOTEBOOKS) or "no-notebooks",
    priority: PRIORITY["normal"]
    shell:
        "{PYTHON} -m tools.book publish {input.executed}"


rule timings:
    """book/generated/timings.md: the recorded chapters' build and how many commits it is behind (tools/book/record.py;
    the count is a param, so a new commit rewrites the page), the committed cold builds (book/cold-builds.json,
    formatted by companion/chapters/cost.py), execution times from the notebooks' provenance, build times from the
    build log."""
    input:
        provenance=[f"{EXECUTED}/{name}.provenance.json" for name in NOTEBOOKS],
        tool="tools/book/steps.py",
        record_tool="tools/book/record.py",
        record=RECORD_MANIFEST,
        cold_builds="book/cold-builds.json",
        cost="companion/chapters/cost.py",
    output:
        "book/generated/timings.md",
    params:
        record_behind=RECORD_BEHIND,
    priority: PRIORITY["normal"]
    shell:
        "{PYTHON} -m tools.book timings"


rule book:
    """jupyter-book build -W (execution off): every chapter is an executed notebook published above."""
    input:
        chapters=PUBLISHED,
        timings="book/generated/timings.md",
        sources=BOOK_SOURCES,
        mathjax=rules.mathjax.output,
        tool="tools/book/steps.py",
    output:
        BOOK_INDEX,
    params:
        output=f"--output {BOOK_BASE}" if config.get("book_output") else "",
    priority: PRIORITY["normal"]
    shell:
        "{PYTHON} -m tools.book jupyter-book {params.output}"
