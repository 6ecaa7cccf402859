"""Run directories -> tidy tables -> statistics -> the paper's claims -> figures -> the report, in floors that import
only those below them (tests/test_imports.py):

    report/    the page: sections, HTML/Markdown blocks, assembly (`python -m analysis report`)
    figures/   drawing only: one module per figure, the matplotlib style
    claims/    the paper's claims C1-C6, one module each, the tables they read, declared comparisons, the scorecard
    stats/     intervals, windows and curves, power, design, collapse, gain, fits, regimes, strata, verdicts
    runs/      reading run directories (the `runfiles` contract) into tidy tables; names and vocabulary
"""
